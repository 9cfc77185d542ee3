//! What the real registry does on its own when a Service is updated, as far as
//! the load-balancer controller sees it (kube-apiserver v1.36 behaviour, checked
//! against the real server in tests): a type change away from LoadBalancer drops
//! `spec.loadBalancerClass` (when the update leaves it as it was) and clears
//! `status.loadBalancer`; `spec.loadBalancerClass` may not change while the
//! Service stays a LoadBalancer (422 Invalid), nor be set on another type; and
//! `status.loadBalancer.ingress` is only for type LoadBalancer.
use serde_json::{json, Value};

use super::{store::Part, ApiError};

fn is_lb(svc: &Value) -> bool {
    svc["spec"]["type"] == "LoadBalancer"
}

fn invalid(name: &str, field: &str, reason: &str, detail: String) -> ApiError {
    let mut e = ApiError::new(422, "Invalid", format!("Service \"{name}\" is invalid: {field}: {detail}"));
    e.details = Some(json!({ "name": name, "kind": "Service", "causes": [{ "reason": reason, "message": detail, "field": field }] }));
    e
}

/// Adjusts and checks `new` (the Service as it will be stored) against `old`.
pub(super) fn prepare_update(old: &Value, new: &mut Value, part: Part) -> Result<(), ApiError> {
    let name = new["metadata"]["name"].as_str().unwrap_or_default().to_owned();
    let class = |s: &Value| s["spec"].get("loadBalancerClass").cloned().unwrap_or(Value::Null);
    if part == Part::Main {
        if is_lb(old) && !is_lb(new) {
            if class(new) == class(old) {
                if let Some(spec) = new["spec"].as_object_mut() {
                    spec.remove("loadBalancerClass");
                }
            }
            if new["status"].is_object() {
                new["status"]["loadBalancer"] = json!({});
            }
        }
        if is_lb(old) && is_lb(new) && class(new) != class(old) {
            let detail = format!("Invalid value: {}: may not change once set", class(new));
            return Err(invalid(&name, "spec.loadBalancerClass", "FieldValueInvalid", detail));
        }
        if !is_lb(new) && !class(new).is_null() {
            let detail = "Forbidden: may only be used when `type` is 'LoadBalancer'".to_owned();
            return Err(invalid(&name, "spec.loadBalancerClass", "FieldValueForbidden", detail));
        }
    }
    if part == Part::Status && !is_lb(new) && new["status"]["loadBalancer"]["ingress"].as_array().is_some_and(|i| !i.is_empty()) {
        let detail = "Forbidden: may only be used when `spec.type` is 'LoadBalancer'".to_owned();
        return Err(invalid(&name, "status.loadBalancer.ingress", "FieldValueForbidden", detail));
    }
    Ok(())
}
