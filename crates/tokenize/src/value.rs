//! Conversion of request JSON into template values. Object key order is kept (Python dicts keep
//! insertion order, and templates print tools and arguments with `tojson`).

use minijinja::Value;

use crate::json::{Json, Map};

/// Request JSON → template value, keeping key order.
pub fn json_to_value(v: &Json) -> Value {
    match v {
        Json::Null => Value::from(()),
        Json::Bool(b) => Value::from(*b),
        Json::Number(n) => {
            if let Some(i) = n.as_i64() {
                Value::from(i)
            } else if let Some(u) = n.as_u64() {
                Value::from(u)
            } else {
                Value::from(n.as_f64().unwrap_or(f64::NAN))
            }
        }
        Json::String(s) => Value::from(s.as_str()),
        Json::Array(items) => Value::from(items.iter().map(json_to_value).collect::<Vec<_>>()),
        Json::Object(map) => map_to_value(map),
    }
}

/// An object → template map, keeping key order.
pub fn map_to_value(map: &Map) -> Value {
    Value::from_pairs(
        map.iter()
            .map(|(k, v)| (Value::from(k.as_str()), json_to_value(v))),
    )
}
