//! Conversion of request JSON into template values. Object key order is kept (Python dicts keep
//! insertion order, and templates print tools and arguments with `tojson`).

use std::fmt;
use std::sync::Arc;

use minijinja::value::{Enumerator, Object, ObjectExt, ValueKind};
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

/// A map with a few distinct keys in insertion order, for the maps built anew for every request
/// (one per message). Templates see exactly what `Value::from_pairs` gives them: the same four
/// `Object` methods minijinja's own map implements, answering the same, over the same pairs; the
/// difference is that nothing hashes every key into a table per message, which lookups by name
/// skip anyway (minijinja scans maps of up to 12 keys).
/// The keys must be distinct: a repeated key is not merged into one as in a map.
pub(crate) struct SmallMap(Vec<(Value, Value)>);

impl SmallMap {
    /// The template value of `pairs` (distinct keys).
    pub(crate) fn value(pairs: Vec<(Value, Value)>) -> Value {
        Value::from_object(SmallMap(pairs))
    }
}

/// As an `IndexMap` prints itself.
impl fmt::Debug for SmallMap {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_map()
            .entries(self.0.iter().map(|(k, v)| (k, v)))
            .finish()
    }
}

impl Object for SmallMap {
    fn get_value(self: &Arc<Self>, key: &Value) -> Option<Value> {
        self.0
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.clone())
    }

    fn get_value_by_str(self: &Arc<Self>, key: &str) -> Option<Value> {
        self.0
            .iter()
            .find(|(k, _)| k.kind() == ValueKind::String && k.as_str() == Some(key))
            .map(|(_, v)| v.clone())
    }

    fn enumerate(self: &Arc<Self>) -> Enumerator {
        self.mapped_rev_key_value_enumerator(|this| {
            Box::new(this.0.iter().map(|(k, v)| (k.clone(), v.clone())))
        })
    }

    fn enumerator_len(self: &Arc<Self>) -> Option<usize> {
        Some(self.0.len())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::template::ChatTemplate;

    /// SmallMap against minijinja's own map, through everything a template can do with a dict.
    #[test]
    fn small_maps_behave_as_minijinjas_maps() {
        let args = Json::parse(
            r#"[{"function": {"name": "f", "arguments": {"b": 1, "a": [2.5, null]}}}]"#,
        )
        .unwrap_or_default();
        let pairs = vec![
            (Value::from("role"), Value::from("assistant")),
            (
                Value::from("content"),
                Value::from("it's a message longer than a small string"),
            ),
            (Value::from("tool_calls"), json_to_value(&args)),
            (Value::from("name"), Value::from(())),
        ];
        let exprs = [
            "{{ m }}",
            "{{ m | tojson }}",
            "{{ m | tojson(indent=2, sort_keys=true) }}",
            "{{ m.role }}",
            "{{ m['content'] }}",
            "{{ m.missing is defined }}",
            "{{ m.name is none }}",
            "{{ m.get('role') }}",
            "{{ m.get('x', 'd') }}",
            "{{ m | length }}",
            "{{ m | list }}",
            "{% for k in m %}{{ loop.index }}{{ k }},{% endfor %}",
            "{% for k, v in m.items() %}{{ k }}={{ v }};{% endfor %}",
            "{{ m.keys() | list }}",
            "{{ m.values() | list }}",
            "{{ m | items | list }}",
            "{{ m | dictsort }}",
            "{{ m | reverse | list }}",
            "{{ m | first }}",
            "{{ m | last }}",
            "{{ 'role' in m }}",
            "{{ 'x' in m }}",
            "{{ 0 in m }}",
            "{{ m[0] is defined }}",
            "{{ m == o }}",
            "{{ m != o }}",
            "{{ m == m }}",
            "{{ m is mapping }}",
            "{{ m is iterable }}",
            "{{ m and 1 }}",
            "{% if m %}y{% endif %}",
            "{{ m | string }}",
            "{{ m | pprint }}",
            "{{ m.tool_calls[0].function.arguments | tojson }}",
            "{{ m | map('upper') | list }}",
            "{{ m | dictsort(by='value') }}",
            "{{ [m, o] | unique | list | length }}",
            "{{ m | attr('role') }}",
            "{{ m.items() | map('first') | join(',') }}",
            "{{ m | selectattr('role') | list }}",
            "{{ dict(m, extra=1) | tojson }}",
            "{{ m | trim }}",
            "{{ m + 1 }}",
            "{{ m.role.upper() }}",
            "{{ m | count }}",
        ];
        let other = Value::from_pairs(pairs.clone());
        let render = |m: Value, src: &str| {
            let ctx = Value::from_pairs([("m", m), ("o", other.clone())]);
            ChatTemplate::new(src)
                .and_then(|t| t.render(ctx))
                .map_err(|e| e.to_string())
        };
        for src in exprs {
            let want = render(Value::from_pairs(pairs.clone()), src);
            let got = render(SmallMap::value(pairs.clone()), src);
            assert_eq!(got, want, "{src}");
        }
        let (want, got) = (Value::from_pairs(pairs.clone()), SmallMap::value(pairs));
        assert_eq!(got.to_string(), want.to_string());
        assert_eq!(format!("{got:?}"), format!("{want:?}"));
        assert_eq!(got.kind(), want.kind());
        assert_eq!(got.len(), want.len());
        assert_eq!(got, want);
    }
}
