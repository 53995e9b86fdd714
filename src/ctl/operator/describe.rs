//! `sandboxctl describe ID`: one sandbox for a person: spec beside status,
//! conditions, lease timing, checkpoints.

use super::*;

/// `describe ID`: spec beside status, conditions, lease timing, checkpoints.
pub async fn describe(
    store: &dyn Store,
    id: &str,
    now: DateTime<Utc>,
) -> Result<String, OperatorError> {
    let sandbox = parse_id(id)?;
    let (metadata, generation, _) = read_metadata(store, &sandbox).await?;
    let lease = read_lease(store, &sandbox).await?;
    let spec = &metadata.spec;
    let status = &metadata.status;
    let mut out = String::new();
    let or_dash = |value: Option<String>| value.unwrap_or_else(|| "-".to_owned());
    let _ = writeln!(out, "Sandbox:      {}", metadata.sandbox_id);
    let _ = writeln!(
        out,
        "Created:      {} ({} ago)",
        metadata.created_at.to_rfc3339(),
        ago(now, metadata.created_at)
    );
    let _ = writeln!(out, "Generation:   {}", generation.0);
    let _ = writeln!(
        out,
        "\nSpec (desired)                          Status (observed)"
    );
    let rows = [
        (
            format!("desired_state: {:?}", spec.desired_state).to_lowercase(),
            format!("phase: {:?}", status.phase),
        ),
        (
            format!(
                "idle_timeout: {}",
                or_dash(spec.idle_timeout.map(|s| format!("{s}s")))
            ),
            format!(
                "holder: {}",
                or_dash(status.holder.as_ref().map(ToString::to_string))
            ),
        ),
        (
            format!("enable_checkpoint: {}", spec.enable_checkpoint),
            format!("epoch: {}", status.epoch),
        ),
        (
            format!("enable_sandbox_handoff: {}", spec.enable_sandbox_handoff),
            format!("last_error: {}", or_dash(status.last_error.clone())),
        ),
        (
            format!(
                "auto_checkpoint_on_idle: {}",
                spec.enable_idle_timeout_auto_checkpoint
            ),
            String::new(),
        ),
        (
            format!(
                "filesystem_snapshot_name: {}",
                or_dash(spec.filesystem_snapshot_name.clone())
            ),
            String::new(),
        ),
        (
            format!(
                "workspace: {}",
                or_dash(
                    spec.workspace
                        .as_ref()
                        .map(|w| format!("{} (template {})", w.id, w.template))
                )
            ),
            String::new(),
        ),
    ];
    for (left, right) in rows {
        let _ = writeln!(out, "  {left:<38}{right}");
    }
    let _ = writeln!(out, "\nConditions:");
    if status.conditions.is_empty() {
        let _ = writeln!(out, "  (none)");
    }
    for condition in &status.conditions {
        let _ = writeln!(
            out,
            "  {:<8} {:<8} {:<14} {} ago  {}",
            condition.kind,
            format!("{:?}", condition.status),
            condition.reason,
            ago(now, condition.last_transition_time),
            condition.message
        );
    }
    let _ = writeln!(out, "\nLease:");
    match &lease {
        None => {
            let _ = writeln!(out, "  (no lock.json)");
        }
        Some((lease, generation)) => {
            let holder = or_dash(lease.holder.as_ref().map(ToString::to_string));
            let _ = writeln!(
                out,
                "  holder: {holder}   epoch: {}   generation: {}",
                lease.epoch, generation.0
            );
            match lease.expires_at() {
                Some(expires) if lease.holder.is_some() && expires > now => {
                    let _ = writeln!(
                        out,
                        "  renewed {} ago, expires in {}s",
                        lease.renewed_at.map_or("-".into(), |t| ago(now, t)),
                        (expires - now).num_seconds()
                    );
                }
                Some(_) if lease.holder.is_some() => {
                    let _ = writeln!(out, "  EXPIRED: another instance may take it over");
                }
                _ => {
                    let _ = writeln!(out, "  free");
                }
            }
            if let Some(intent) = &lease.wanted_by {
                let live = if intent.expires_at > now {
                    ""
                } else {
                    " (expired)"
                };
                let _ = writeln!(
                    out,
                    "  wanted_by: {} since {} ago{live}",
                    intent.instance,
                    ago(now, intent.requested_at)
                );
            }
        }
    }
    let _ = writeln!(out, "\nCheckpoints:");
    // A checkpoint the lock carries and `status` does not record yet (a
    // hand-back's record that has not landed, or never did), or that its
    // hold took over before a former holder's late record: it is the
    // latest, and what the next holder restores (decision 18).
    let lock = lease.as_ref().map(|(lease, _)| lease);
    let carried = lock
        .and_then(|lock| lock.checkpoint.as_ref().map(|carried| (lock, carried)))
        .filter(|(lock, _)| {
            let mut folded = status.clone();
            controllers::sandboxes::record_carried(&mut folded, lock, usize::MAX);
            folded.latest_checkpoint.as_ref() != status.latest_checkpoint.as_ref()
        });
    let mut lines: Vec<(String, &controllers::api::CheckpointRef, &str)> = Vec::new();
    if let Some((lock, carried)) = carried {
        let recorded_late = status
            .latest_checkpoint
            .as_ref()
            .is_some_and(|latest| lock.outdates(latest));
        let note = if recorded_late {
            "  (carried by lock.json: its hold started from it; the record below came late from an earlier hold)"
        } else {
            "  (carried by lock.json: its record in metadata.json has not landed)"
        };
        lines.push(("latest".to_owned(), carried, note));
    }
    if let Some(latest) = &status.latest_checkpoint {
        let label = if carried.is_some() {
            "recorded"
        } else {
            "latest"
        };
        lines.push((label.to_owned(), latest, ""));
    }
    for previous in &status.previous_checkpoints {
        lines.push(("previous".to_owned(), previous, ""));
    }
    for (name, named) in &status.named_checkpoints {
        lines.push((format!("named:{name}"), named, ""));
    }
    let any = !lines.is_empty();
    for (label, checkpoint, note) in lines {
        let _ = writeln!(
            out,
            "  {label:<10} {}  {} bytes  epoch {}  {} ago{}{note}",
            checkpoint.path,
            checkpoint.size,
            checkpoint.epoch,
            ago(now, checkpoint.created_at),
            checkpoint
                .name
                .as_ref()
                .map_or(String::new(), |n| format!("  name {n}"))
        );
    }
    if !any {
        let _ = writeln!(out, "  (none)");
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use controllers::api::{CheckpointRef, SandboxMetadata, encode};
    use controllers::layout::{lock_key, metadata_key};
    use controllers::store::PutMode;
    use controllers::testing::MemoryStore;

    use super::*;

    fn checkpoint(id: &str, epoch: u64, at: DateTime<Utc>) -> CheckpointRef {
        serde_json::from_value(serde_json::json!({
            "bucket": "b", "path": format!("sandbox_checkpoints/{id}/checkpoint.img"),
            "epoch": epoch, "sha256": "ab".repeat(32), "size": 1, "created_at": at,
        }))
        .unwrap()
    }

    /// A former holder's record that landed after the lock's hold took its
    /// checkpoint over is shown as what it is, under the lock's latest.
    #[tokio::test]
    async fn a_late_record_of_an_earlier_hold_is_shown_as_such() {
        let (store, now, id) = (MemoryStore::new(), Utc::now(), SandboxId::random());
        let mut metadata = SandboxMetadata::new(id.clone(), now, "ab".repeat(32));
        metadata.status.epoch = 1;
        metadata.status.latest_checkpoint = Some(checkpoint("late", 1, now));
        let mut lock = Lease::unheld(30);
        (lock.epoch, lock.checkpoint_taken_over_at) = (2, Some(2));
        lock.checkpoint = Some(checkpoint("taken", 1, now - chrono::Duration::minutes(1)));
        for (key, data) in [
            (metadata_key(&id), encode(&metadata)),
            (lock_key(&id), encode(&lock)),
        ] {
            store.put(&key, data, PutMode::Create).await.unwrap();
        }
        let out = describe(&store, id.as_str(), now).await.unwrap();
        let latest = out.lines().find(|line| line.contains("latest")).unwrap();
        assert!(latest.contains("sandbox_checkpoints/taken/"), "{out}");
        assert!(
            latest.contains("the record below came late from an earlier hold"),
            "{out}"
        );
        assert!(
            out.contains("recorded   sandbox_checkpoints/late/"),
            "{out}"
        );
    }
}
