//! `sandboxctl list` and `get`: read every sandbox's documents and summarise
//! them. Unreadable documents are shown with their error, never skipped.

use chrono::{DateTime, Utc};
use controllers::api::{Lease, SandboxId, SandboxMetadata, decode};
use controllers::layout::{SANDBOXES_PREFIX, lock_key, metadata_key};
use controllers::store::{Store, StoreError};

/// One line of `sandboxctl list`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SandboxRow {
    pub id: String,
    pub phase: String,
    pub holder: String,
    pub epoch: String,
    pub wanted_by: String,
    pub age: String,
    pub checkpoint_size: String,
}

/// Reads every sandbox under `sandboxes/` and summarises it.
pub async fn list_rows(
    store: &dyn Store,
    now: DateTime<Utc>,
) -> Result<Vec<SandboxRow>, StoreError> {
    let mut ids: Vec<String> = store
        .list_all(SANDBOXES_PREFIX)
        .await?
        .into_iter()
        .filter_map(|object| {
            let rest = object.key.as_str().strip_prefix(SANDBOXES_PREFIX)?;
            rest.split_once('/').map(|(id, _)| id.to_owned())
        })
        .collect();
    ids.dedup();
    let mut rows = Vec::with_capacity(ids.len());
    for id in ids {
        rows.push(row(store, &id, now).await?);
    }
    Ok(rows)
}

async fn row(store: &dyn Store, id: &str, now: DateTime<Utc>) -> Result<SandboxRow, StoreError> {
    let dash = || "-".to_owned();
    let mut row = SandboxRow {
        id: id.to_owned(),
        phase: dash(),
        holder: dash(),
        epoch: dash(),
        wanted_by: dash(),
        age: dash(),
        checkpoint_size: dash(),
    };
    let Ok(sandbox) = SandboxId::parse(id) else {
        row.phase = "INVALID-ID".to_owned();
        return Ok(row);
    };
    match read::<SandboxMetadata>(store, &metadata_key(&sandbox)).await? {
        Some(Ok(metadata)) => {
            row.phase = format!("{:?}", metadata.status.phase);
            row.age = age(now, metadata.created_at);
            if let Some(checkpoint) = &metadata.status.latest_checkpoint {
                row.checkpoint_size = human_size(checkpoint.size);
            }
        }
        Some(Err(err)) => row.phase = format!("INVALID ({err})"),
        None => row.phase = "NO-METADATA".to_owned(),
    }
    match read::<Lease>(store, &lock_key(&sandbox)).await? {
        Some(Ok(lease)) => {
            row.holder = lease
                .holder
                .as_ref()
                .map_or_else(|| "<none>".to_owned(), ToString::to_string);
            row.epoch = lease.epoch.to_string();
            if let Some(intent) = lease.live_intent(now) {
                row.wanted_by = intent.instance.to_string();
            }
        }
        Some(Err(err)) => row.holder = format!("INVALID ({err})"),
        None => {}
    }
    Ok(row)
}

async fn read<T: controllers::api::ApiObject>(
    store: &dyn Store,
    key: &controllers::store::ObjectKey,
) -> Result<Option<Result<T, controllers::api::DecodeError>>, StoreError> {
    match store.get(key).await {
        Ok(object) => Ok(Some(decode::<T>(&object.data))),
        Err(StoreError::NotFound { .. }) => Ok(None),
        Err(err) => Err(err),
    }
}

/// `sandboxctl get ID`: both documents as one JSON value, as stored.
pub async fn describe_json(
    store: &dyn Store,
    sandbox: &SandboxId,
) -> Result<serde_json::Value, StoreError> {
    let metadata = store.get(&metadata_key(sandbox)).await?;
    let lock = match store.get(&lock_key(sandbox)).await {
        Ok(lock) => Some(lock),
        Err(StoreError::NotFound { .. }) => None,
        Err(err) => return Err(err),
    };
    let parse = |bytes: &[u8]| {
        serde_json::from_slice::<serde_json::Value>(bytes)
            .unwrap_or_else(|err| serde_json::Value::String(format!("invalid JSON: {err}")))
    };
    Ok(serde_json::json!({
        "metadata": parse(&metadata.data),
        "metadata_generation": metadata.generation.0,
        "lock": lock.as_ref().map(|lock| parse(&lock.data)),
        "lock_generation": lock.as_ref().map(|lock| lock.generation.0),
    }))
}

/// Formats rows as an aligned table with a header.
pub fn render_table(rows: &[SandboxRow]) -> String {
    let header = [
        "ID",
        "PHASE",
        "HOLDER",
        "EPOCH",
        "WANTED_BY",
        "AGE",
        "CHECKPOINT",
    ];
    let cells: Vec<[&str; 7]> = rows
        .iter()
        .map(|r| {
            [
                r.id.as_str(),
                r.phase.as_str(),
                r.holder.as_str(),
                r.epoch.as_str(),
                r.wanted_by.as_str(),
                r.age.as_str(),
                r.checkpoint_size.as_str(),
            ]
        })
        .collect();
    aligned(&header, &cells)
}

/// An aligned table: the header, then one line per row, columns padded to
/// their widest cell.
pub(super) fn aligned<const N: usize>(header: &[&str; N], rows: &[[&str; N]]) -> String {
    let widths: Vec<usize> = (0..N)
        .map(|i| {
            rows.iter()
                .map(|c| c[i].len())
                .chain([header[i].len()])
                .max()
                .unwrap_or(0)
        })
        .collect();
    let line = |columns: &[&str]| {
        let padded: Vec<String> = columns
            .iter()
            .zip(&widths)
            .map(|(cell, width)| format!("{cell:<width$}"))
            .collect();
        padded.join("  ").trim_end().to_owned() + "\n"
    };
    let mut out = line(header);
    for row in rows {
        out.push_str(&line(row));
    }
    out
}

/// `now - then` in a short human form (`42s`, `7m`, `3h`, `2d`).
pub(super) fn age(now: DateTime<Utc>, then: DateTime<Utc>) -> String {
    let secs = (now - then).num_seconds().max(0);
    match secs {
        s if s < 120 => format!("{s}s"),
        s if s < 7200 => format!("{}m", s / 60),
        s if s < 172_800 => format!("{}h", s / 3600),
        s => format!("{}d", s / 86_400),
    }
}

fn human_size(bytes: u64) -> String {
    const UNITS: [&str; 4] = ["B", "KiB", "MiB", "GiB"];
    let mut value = bytes as f64;
    let mut unit = 0;
    while value >= 1024.0 && unit < UNITS.len() - 1 {
        value /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{bytes}B")
    } else {
        format!("{value:.1}{}", UNITS[unit])
    }
}
