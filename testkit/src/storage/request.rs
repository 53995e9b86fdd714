//! Reading a GCS JSON-API request: its kind, the object it names, and
//! whether it mutates that object (what GCS's per-object rate counts).

use super::record::RequestKind;

/// What the model needs to know of one request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Classified {
    pub kind: RequestKind,
    /// The object, when the path names it (`""` otherwise: an upload names
    /// it in its body, see [`object_in_body`]).
    pub object: String,
    /// An upload that starts a new object generation, a delete, a rewrite,
    /// a metadata patch. A resumable upload counts once, at its start.
    pub mutation: bool,
    /// An upload whose object name is in its JSON body (multipart, or the
    /// start of a resumable upload without `name=`).
    pub name_in_body: bool,
    /// The `upload_id` of a resumable upload's data request.
    pub upload_id: Option<String>,
}

/// Classifies `method path?query`.
pub fn classify(method: &str, path: &str, query: Option<&str>) -> Classified {
    let param = |name: &str| {
        query.and_then(|q| {
            q.split('&')
                .filter_map(|pair| pair.split_once('='))
                .find(|(key, _)| *key == name)
                .map(|(_, value)| percent_decode(value))
        })
    };
    let reading = matches!(method, "GET" | "HEAD");
    if let Some(rest) = path.strip_prefix("/upload/storage/v1/b/") {
        let _bucket = rest.split('/').next();
        let upload_id = param("upload_id");
        let named = param("name");
        return Classified {
            kind: RequestKind::Write,
            object: named.clone().unwrap_or_default(),
            mutation: method == "POST" && upload_id.is_none(),
            name_in_body: method == "POST" && upload_id.is_none() && named.is_none(),
            upload_id,
        };
    }
    let rest = path
        .strip_prefix("/download/storage/v1/b/")
        .or_else(|| path.strip_prefix("/storage/v1/b/"));
    let Some(rest) = rest else {
        return Classified {
            kind: if reading {
                RequestKind::Read
            } else {
                RequestKind::Write
            },
            object: String::new(),
            mutation: false,
            name_in_body: false,
            upload_id: None,
        };
    };
    // {bucket}[/o[/{object}[/rewriteTo/b/{bucket}/o/{object}]]]
    let mut parts = rest.splitn(3, '/');
    let _bucket = parts.next();
    let objects = parts.next() == Some("o");
    let object_path = parts.next().unwrap_or("");
    let (object, destination) = match object_path.split_once("/rewriteTo/b/") {
        Some((source, target)) => (source, target.split_once("/o/").map(|(_, object)| object)),
        None => (object_path, None),
    };
    let kind = if !objects || !object.is_empty() {
        if reading {
            RequestKind::Read
        } else {
            RequestKind::Write
        }
    } else if reading {
        RequestKind::List
    } else {
        RequestKind::Write
    };
    let object = percent_decode(destination.unwrap_or(object));
    Classified {
        kind,
        mutation: kind == RequestKind::Write && objects && !object.is_empty(),
        object,
        name_in_body: false,
        upload_id: None,
    }
}

/// The `"name"` of the first JSON object in an upload's body (a multipart
/// upload's metadata part, or a resumable upload's start).
pub fn object_in_body(body: &[u8]) -> Option<String> {
    let start = body.iter().position(|b| *b == b'{')?;
    let mut values =
        serde_json::Deserializer::from_slice(&body[start..]).into_iter::<serde_json::Value>();
    let first = values.next()?.ok()?;
    first.get("name")?.as_str().map(str::to_owned)
}

/// The `upload_id` in a resumable upload's `Location`.
pub fn upload_id_of(location: &str) -> Option<String> {
    let query = location.split_once('?')?.1;
    query
        .split('&')
        .filter_map(|pair| pair.split_once('='))
        .find(|(key, _)| *key == "upload_id")
        .map(|(_, value)| percent_decode(value))
}

/// `%2F` → `/` and so on; anything malformed is kept as it is.
fn percent_decode(text: &str) -> String {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let hex = |b: u8| char::from(b).to_digit(16);
        if bytes[i] == b'%'
            && i + 2 < bytes.len()
            && let (Some(high), Some(low)) = (hex(bytes[i + 1]), hex(bytes[i + 2]))
        {
            out.push(u8::try_from(high * 16 + low).unwrap_or(b'?'));
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_are_read_as_gcs_bills_and_limits_them() {
        let read = classify(
            "GET",
            "/storage/v1/b/bkt/o/sandboxes%2Fab%2Flock.json",
            Some("alt=media"),
        );
        assert_eq!(read.kind, RequestKind::Read);
        assert_eq!(read.object, "sandboxes/ab/lock.json");
        assert!(!read.mutation);

        let list = classify("GET", "/storage/v1/b/bkt/o", Some("prefix=sandboxes%2F"));
        assert_eq!((list.kind, list.mutation), (RequestKind::List, false));

        let upload = classify(
            "POST",
            "/upload/storage/v1/b/bkt/o",
            Some("uploadType=multipart"),
        );
        assert_eq!(upload.kind, RequestKind::Write);
        assert!(upload.mutation && upload.name_in_body);

        let chunk = classify(
            "PUT",
            "/upload/storage/v1/b/bkt/o",
            Some("uploadType=resumable&upload_id=x1"),
        );
        assert!(!chunk.mutation);
        assert_eq!(chunk.upload_id.as_deref(), Some("x1"));

        let delete = classify("DELETE", "/storage/v1/b/bkt/o/a%2Fb", None);
        assert_eq!(
            (delete.kind, delete.object.as_str(), delete.mutation),
            (RequestKind::Write, "a/b", true)
        );

        let rewrite = classify(
            "POST",
            "/storage/v1/b/bkt/o/a%2Fsrc/rewriteTo/b/bkt/o/a%2Fdst",
            None,
        );
        assert_eq!((rewrite.object.as_str(), rewrite.mutation), ("a/dst", true));

        let bucket = classify("POST", "/storage/v1/b", Some("project=test"));
        assert_eq!((bucket.kind, bucket.mutation), (RequestKind::Write, false));
    }

    #[test]
    fn upload_bodies_and_locations_name_their_object() {
        let body = b"--b\r\ncontent-type: application/json\r\n\r\n{\"name\":\"sandboxes/x/lock.json\",\"ifGenerationMatch\":\"0\"}\r\n--b\r\n\r\n{\"holder\":1}\r\n--b--";
        assert_eq!(
            object_in_body(body).as_deref(),
            Some("sandboxes/x/lock.json")
        );
        assert_eq!(object_in_body(b"no json"), None);
        assert_eq!(
            upload_id_of(
                "http://127.0.1.2/upload/storage/v1/b/b/o?uploadType=resumable&upload_id=ab%3D"
            )
            .as_deref(),
            Some("ab=")
        );
    }
}
