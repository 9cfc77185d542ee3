//! `labelSelector` and `fieldSelector` query parameters.

use super::ApiError;
use serde_json::Value;

/// Both selectors of one list or watch request.
#[derive(Clone, Debug, Default)]
pub(crate) struct Filter {
    namespace: Option<String>,
    labels: Vec<LabelReq>,
    fields: Vec<FieldReq>,
}

#[derive(Clone, Debug)]
enum LabelReq {
    Eq(String, String),
    NotEq(String, String),
    In(String, Vec<String>),
    NotIn(String, Vec<String>),
    Exists(String),
    NotExists(String),
}

#[derive(Clone, Debug)]
struct FieldReq {
    path: String,
    value: String,
    equal: bool,
}

impl Filter {
    pub(crate) fn new(namespace: Option<&str>, labels: Option<&str>, fields: Option<&str>) -> Result<Self, ApiError> {
        Ok(Filter {
            namespace: namespace.map(str::to_owned),
            labels: labels.map(parse_labels).transpose()?.unwrap_or_default(),
            fields: fields.map(parse_fields).transpose()?.unwrap_or_default(),
        })
    }

    pub(crate) fn matches(&self, obj: &Value) -> bool {
        let meta = &obj["metadata"];
        if let Some(ns) = &self.namespace {
            if meta["namespace"].as_str() != Some(ns.as_str()) {
                return false;
            }
        }
        let label = |k: &str| meta["labels"][k].as_str();
        let labels_ok = self.labels.iter().all(|r| match r {
            LabelReq::Eq(k, v) => label(k) == Some(v.as_str()),
            // Like the real server: `k!=v` also matches objects without the label.
            LabelReq::NotEq(k, v) => label(k) != Some(v.as_str()),
            LabelReq::In(k, vs) => label(k).is_some_and(|l| vs.iter().any(|v| v == l)),
            LabelReq::NotIn(k, vs) => label(k).is_none_or(|l| vs.iter().all(|v| v != l)),
            LabelReq::Exists(k) => label(k).is_some(),
            LabelReq::NotExists(k) => label(k).is_none(),
        });
        labels_ok
            && self.fields.iter().all(|f| {
                let v = f.path.split('.').try_fold(obj, |v, seg| v.get(seg));
                let s = match v {
                    Some(Value::String(s)) => s.clone(),
                    Some(Value::Null) | None => String::new(),
                    Some(other) => other.to_string(),
                };
                (s == f.value) == f.equal
            })
    }
}

fn bad(msg: String) -> ApiError {
    ApiError::new(400, "BadRequest", msg)
}

/// Splits on commas outside parentheses (`a in (x,y),b`).
fn split_top(s: &str) -> Vec<&str> {
    let (mut out, mut depth, mut start) = (Vec::new(), 0i32, 0);
    for (i, c) in s.char_indices() {
        match c {
            '(' => depth += 1,
            ')' => depth -= 1,
            ',' if depth == 0 => {
                out.push(&s[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    out.push(&s[start..]);
    out.into_iter().map(str::trim).filter(|p| !p.is_empty()).collect()
}

fn parse_labels(s: &str) -> Result<Vec<LabelReq>, ApiError> {
    split_top(s)
        .into_iter()
        .map(|p| {
            let set = |rest: &str| -> Result<Vec<String>, ApiError> {
                let inner = rest.trim().strip_prefix('(').and_then(|r| r.strip_suffix(')'));
                let inner = inner.ok_or_else(|| bad(format!("unable to parse requirement: {p:?}")))?;
                Ok(inner.split(',').map(|v| v.trim().to_owned()).collect())
            };
            if let Some((k, v)) = p.split_once("!=") {
                Ok(LabelReq::NotEq(k.trim().into(), v.trim().into()))
            } else if let Some((k, v)) = p.split_once("==").or_else(|| p.split_once('=')) {
                Ok(LabelReq::Eq(k.trim().into(), v.trim().into()))
            } else if let Some((k, rest)) = p.split_once(" notin ") {
                Ok(LabelReq::NotIn(k.trim().into(), set(rest)?))
            } else if let Some((k, rest)) = p.split_once(" in ") {
                Ok(LabelReq::In(k.trim().into(), set(rest)?))
            } else if let Some(k) = p.strip_prefix('!') {
                Ok(LabelReq::NotExists(k.trim().into()))
            } else if p.contains([' ', '(', ')', '<', '>']) {
                Err(bad(format!("unable to parse requirement: {p:?}")))
            } else {
                Ok(LabelReq::Exists(p.into()))
            }
        })
        .collect()
}

fn parse_fields(s: &str) -> Result<Vec<FieldReq>, ApiError> {
    split_top(s)
        .into_iter()
        .map(|p| {
            let (path, value, equal) = if let Some((k, v)) = p.split_once("!=") {
                (k, v, false)
            } else if let Some((k, v)) = p.split_once("==").or_else(|| p.split_once('=')) {
                (k, v, true)
            } else {
                return Err(bad(format!("invalid field selector: {p:?}")));
            };
            Ok(FieldReq { path: path.trim().into(), value: value.trim().into(), equal })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn obj(name: &str, labels: Value) -> Value {
        json!({"metadata": {"name": name, "namespace": "a", "labels": labels}, "spec": {"port": 80}})
    }

    #[test]
    fn apiserver_label_selectors() {
        let o = obj("x", json!({"app": "web", "tier": "fe"}));
        let m = |s: &str| Filter::new(None, Some(s), None).unwrap().matches(&o);
        assert!(m("app=web") && m("app==web,tier") && m("app in (db, web)") && m("!gone"));
        assert!(m("tier notin (be)") && m("gone!=x"));
        assert!(!m("app=db") && !m("app!=web") && !m("app notin (web)") && !m("!app") && !m("gone"));
        assert!(Filter::new(None, Some("app in web"), None).is_err());
    }

    #[test]
    fn apiserver_field_selectors() {
        let o = obj("x", json!({}));
        let m = |s: &str| Filter::new(None, None, Some(s)).unwrap().matches(&o);
        assert!(m("metadata.name=x") && m("metadata.namespace==a,metadata.name!=y") && m("spec.port=80"));
        assert!(!m("metadata.name=y") && !m("metadata.name!=x"));
        assert!(!Filter::new(Some("b"), None, None).unwrap().matches(&o));
    }
}
