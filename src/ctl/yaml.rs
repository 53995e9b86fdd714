//! `-o yaml`: JSON rendered as block-style YAML. Strings are written as JSON
//! strings, which are valid YAML double-quoted scalars, so nothing is
//! misread (`no`, `1e3`, `null` stay strings).

use serde_json::Value;

pub fn to_yaml(value: &Value) -> String {
    let mut out = String::new();
    match value {
        Value::Object(map) if !map.is_empty() => write_map(&mut out, map, 0),
        Value::Array(items) if !items.is_empty() => write_list(&mut out, items, 0),
        scalar => {
            out.push_str(&inline(scalar));
            out.push('\n');
        }
    }
    out
}

fn inline(value: &Value) -> String {
    match value {
        Value::Object(map) if map.is_empty() => "{}".to_owned(),
        Value::Array(items) if items.is_empty() => "[]".to_owned(),
        other => other.to_string(),
    }
}

fn is_block(value: &Value) -> bool {
    matches!(value, Value::Object(map) if !map.is_empty())
        || matches!(value, Value::Array(items) if !items.is_empty())
}

fn write_map(out: &mut String, map: &serde_json::Map<String, Value>, indent: usize) {
    for (key, value) in map {
        out.push_str(&" ".repeat(indent));
        out.push_str(&Value::String(key.clone()).to_string());
        match value {
            Value::Object(inner) if !inner.is_empty() => {
                out.push_str(":\n");
                write_map(out, inner, indent + 2);
            }
            Value::Array(items) if !items.is_empty() => {
                out.push_str(":\n");
                write_list(out, items, indent + 2);
            }
            scalar => {
                out.push_str(": ");
                out.push_str(&inline(scalar));
                out.push('\n');
            }
        }
    }
}

fn write_list(out: &mut String, items: &[Value], indent: usize) {
    for item in items {
        out.push_str(&" ".repeat(indent));
        if is_block(item) {
            out.push_str("-\n");
            match item {
                Value::Object(map) => write_map(out, map, indent + 2),
                Value::Array(inner) => write_list(out, inner, indent + 2),
                _ => {}
            }
        } else {
            out.push_str("- ");
            out.push_str(&inline(item));
            out.push('\n');
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn nested_documents_render_as_block_yaml_with_safe_strings() {
        let value = json!({"spec": {"desired_state": "running", "labels": {}}, "list": [1, {"a": null}], "no": "no"});
        assert_eq!(
            to_yaml(&value),
            "\"list\":\n  - 1\n  -\n    \"a\": null\n\"no\": \"no\"\n\"spec\":\n  \"desired_state\": \"running\"\n  \"labels\": {}\n"
        );
    }
}
