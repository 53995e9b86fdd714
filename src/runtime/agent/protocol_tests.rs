//! Every message of `sandbox_agent/protocol.json` round-trips through the
//! Rust types unchanged, and every Rust request is in the schema.

use serde_json::json;

use super::*;

const SCHEMA: &str = include_str!("sandbox_agent/protocol.json");

fn schema() -> Value {
    serde_json::from_str(SCHEMA).expect("protocol.json is JSON")
}

/// A value of a schema type (`object` and `T[]` of objects: empty, which
/// every Rust type accepts).
fn sample(kind: &str) -> Value {
    let kind = kind.split('|').next().unwrap_or(kind);
    if let Some(item) = kind.strip_suffix("[]") {
        return if item == "object" {
            json!([])
        } else {
            json!([sample(item)])
        };
    }
    match kind {
        "string" => json!("s1"),
        "integer" => json!(7),
        "number" => json!(1.5),
        "boolean" => json!(true),
        "object" => json!({}),
        other => panic!("protocol.json names an unknown type {other:?}"),
    }
}

/// `fields` (`required` and `optional` of a schema entry) filled in.
fn fill(message: &mut Map<String, Value>, entry: &Value) {
    for part in ["required", "optional"] {
        if let Some(fields) = entry[part].as_object() {
            for (name, kind) in fields {
                message.insert(name.clone(), sample(kind.as_str().expect("a type name")));
            }
        }
    }
}

fn names(entry: &Value) -> Vec<String> {
    let mut names: Vec<String> = ["required", "optional"]
        .iter()
        .filter_map(|part| entry[*part].as_object())
        .flat_map(|fields| fields.keys().cloned())
        .collect();
    names.sort();
    names
}

#[test]
fn the_schema_and_the_host_speak_the_same_version() {
    assert_eq!(schema()["version"], json!(AGENT_PROTOCOL_VERSION));
}

#[test]
fn every_request_of_the_schema_round_trips() {
    let schema = schema();
    let requests = schema["requests"].as_object().expect("requests");
    for (op, entry) in requests {
        let mut message = Map::new();
        message.insert("op".into(), json!(op));
        fill(&mut message, entry);
        let message = Value::Object(message);
        let command: Command = serde_json::from_value(message.clone())
            .unwrap_or_else(|err| panic!("{op}: {err} in {message}"));
        assert_eq!(command.request.op(), op);
        assert_eq!(
            serde_json::to_value(&command).expect("serializes"),
            message,
            "{op} does not round-trip"
        );
    }
}

/// One of each request, as the host builds them.
fn every_request() -> Vec<Command> {
    let id = |request: Request| request.with_id("r1");
    vec![
        id(Request::Exec {
            argv: Some(vec!["bash".into()]),
            session: false,
            code: None,
            env: None,
            cwd: None,
            resumable: false,
            pty: None,
            results: false,
            stdin_window: Some(8 << 20),
        }),
        id(Request::Resize { cols: 80, rows: 24 }),
        id(Request::Stdin {
            data: "eA==".into(),
        }),
        id(Request::StdinClose),
        id(Request::Kill),
        id(Request::Ping),
        id(Request::PrepareCheckpoint {
            force: false,
            keep: true,
            acked: Some(BTreeMap::from([("e1".to_owned(), 3)])),
        }),
        Request::Ack {
            exec: "e1".into(),
            seq: 3,
        }
        .without_id(),
        id(Request::Journals),
        id(Request::Resume { replay: true }),
        id(Request::CloseConnections),
        id(Request::Archive {
            paths: vec!["/tmp".into()],
            since: None,
        }),
        id(Request::ExtractChunk {
            data: "eA==".into(),
        }),
        id(Request::ExtractEnd),
        id(Request::WsScan {
            root: "/workspace".into(),
            max_file_bytes: Some(1),
            max_total_bytes: None,
            max_files: Some(1),
            stale_s: 1,
        }),
        id(Request::WsRead {
            root: "/workspace".into(),
            path: "a".into(),
            max_file_bytes: 1,
        }),
        id(Request::WsWriteChunk {
            root: "/workspace".into(),
            data: "eA==".into(),
        }),
        id(Request::WsWriteEnd {
            root: "/workspace".into(),
            path: "a".into(),
            checksum: "0".repeat(32),
            modified_at: 1,
        }),
        id(Request::WsWriteAbort),
        id(Request::WsDelete {
            root: "/workspace".into(),
            paths: vec!["a".into()],
        }),
        id(Request::WsState {
            root: "/workspace".into(),
            content: "{}".into(),
        }),
        id(Request::FsStat { path: "/a".into() }),
        id(Request::FsList {
            path: "/a".into(),
            depth: 1,
            max_entries: 10,
        }),
        id(Request::FsRead {
            path: "/a".into(),
            offset: 0,
            length: 1,
        }),
        id(Request::FsReadBytes {
            path: "/a".into(),
            offset: 0,
            length: 1,
        }),
        id(Request::FsWrite {
            path: "/a".into(),
            data: "eA==".into(),
            mode: Some(0o644),
            parents: true,
        }),
        id(Request::FsMkdir {
            path: "/a".into(),
            parents: true,
            mode: None,
        }),
        id(Request::FsRemove {
            path: "/a".into(),
            recursive: false,
        }),
        id(Request::FsRename {
            path: "/a".into(),
            to: "/b".into(),
            overwrite: true,
        }),
        id(Request::FsUploadOpen {
            upload: "u1".into(),
            path: "/a".into(),
            mode: None,
            parents: true,
        }),
        id(Request::FsUploadChunk {
            upload: "u1".into(),
            data: "eA==".into(),
        }),
        Command {
            bytes: Some(1),
            ..id(Request::FsUploadBytes {
                upload: "u1".into(),
            })
        },
        id(Request::FsUploadCommit {
            upload: "u1".into(),
            size: 1,
        }),
        id(Request::FsUploadAbort {
            upload: "u1".into(),
        }),
    ]
}

#[test]
fn every_request_the_host_sends_is_in_the_schema_with_its_fields() {
    let schema = schema();
    let requests = schema["requests"].as_object().expect("requests");
    let mut ops: Vec<&str> = Vec::new();
    for command in every_request() {
        let op = command.request.op();
        ops.push(op);
        let entry = requests
            .get(op)
            .unwrap_or_else(|| panic!("{op} is not in protocol.json"));
        let value = serde_json::to_value(&command).expect("serializes");
        let allowed = names(entry);
        for field in value.as_object().expect("an object").keys() {
            assert!(
                field == "op" || allowed.contains(field),
                "{op} sends {field:?}, which protocol.json does not list"
            );
        }
        for field in entry["required"].as_object().into_iter().flatten() {
            assert!(value.get(field.0).is_some(), "{op} lacks {:?}", field.0);
        }
    }
    ops.sort_unstable();
    let mut listed: Vec<&str> = requests.keys().map(String::as_str).collect();
    listed.sort_unstable();
    assert_eq!(
        ops, listed,
        "every_request() and protocol.json list other ops"
    );
}

#[test]
fn every_event_of_the_schema_round_trips() {
    let schema = schema();
    for (ev, entry) in schema["events"].as_object().expect("events") {
        let mut message = Map::new();
        message.insert("ev".into(), json!(ev));
        fill(&mut message, entry);
        let message = Value::Object(message);
        let event: Event = serde_json::from_value(message.clone())
            .unwrap_or_else(|err| panic!("{ev}: {err} in {message}"));
        assert_eq!(event.kind(), ev);
        assert_eq!(serde_json::to_value(&event).expect("serializes"), message);
    }
}

/// The reply type the host reads `op`'s reply as, back to JSON.
fn typed_reply(op: &str, event: Event) -> Option<Value> {
    fn again<T: serde::Serialize + DeserializeOwned>(event: Event) -> Value {
        let typed: T = event.reply().expect("the reply type reads it");
        serde_json::to_value(typed).expect("serializes")
    }
    Some(match op {
        "ping" => again::<Pong>(event),
        "journals" => again::<JournalsReply>(event),
        "prepare_checkpoint" => again::<CheckpointReady>(event),
        "close_connections" => again::<ConnectionsClosed>(event),
        "archive" => again::<ArchiveDone>(event),
        "extract_end" => again::<ExtractDone>(event),
        "ws_scan" => again::<ScanDone>(event),
        "ws_read" => again::<ReadDone>(event),
        "ws_delete" => again::<DeleteDone>(event),
        "fs_list" => again::<ListDone>(event),
        "fs_read" => again::<FsReadDone>(event),
        "fs_read_bytes" => again::<FsReadBytesDone>(event),
        "fs_upload_chunk" | "fs_upload_bytes" => again::<ChunkDone>(event),
        _ => return None,
    })
}

#[test]
fn every_reply_of_the_schema_reads_as_its_reply_type() {
    let schema = schema();
    let events = &schema["events"];
    for (op, entry) in schema["requests"].as_object().expect("requests") {
        let Some(reply) = entry.get("reply") else {
            continue;
        };
        let ev = reply["ev"].as_str().expect("reply.ev");
        let mut message = Map::new();
        message.insert("ev".into(), json!(ev));
        fill(&mut message, &events[ev]);
        let mut body = Map::new();
        fill(&mut body, reply);
        message.extend(body.clone());
        let message = Value::Object(message);
        let event: Event = serde_json::from_value(message.clone())
            .unwrap_or_else(|err| panic!("{op}'s reply: {err} in {message}"));
        assert_eq!(serde_json::to_value(&event).expect("serializes"), message);
        if let Some(typed) = typed_reply(op, event) {
            let expected = match ev {
                "ready" | "done" => Value::Object(body),
                _ => {
                    let mut fields = message.as_object().cloned().unwrap_or_default();
                    fields.remove("ev");
                    fields.remove("id");
                    Value::Object(fields)
                }
            };
            assert_eq!(
                typed, expected,
                "{op}'s reply type and protocol.json differ"
            );
        }
    }
}

#[test]
fn a_reply_without_its_fields_is_malformed() {
    let event: Event = serde_json::from_value(json!({"ev": "done", "id": "r1"})).expect("an event");
    let err = event.reply::<ReadDone>().expect_err("no checksum");
    assert!(err.to_string().contains("\"done\" reply"), "{err}");
}
