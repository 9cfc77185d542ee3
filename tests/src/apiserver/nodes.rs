//! The `node.kubernetes.io/not-ready:NoSchedule` taint on new Nodes.
//!
//! The real kube-apiserver adds it itself: its TaintNodesByCondition admission
//! plugin (on by default; plugin/pkg/admission/nodetaint) taints every Node created
//! through the API unless a taint of that key and effect is already there, so a
//! Node a kubelet registers starts out not ready for scheduling (checked against
//! v1.36 in tests/tests/k8s_strict.rs). Lifting it is the node lifecycle
//! controller's job once the Node reports Ready; there is none here (nor with a
//! bare kube-apiserver), so a test does it through the API, as
//! `kubefix::lift_not_ready_taint` does.
use serde_json::{json, Value};

pub const NOT_READY: &str = "node.kubernetes.io/not-ready";

/// Adds the taint to a Node being created, unless it has one of that key and effect.
pub(super) fn taint_not_ready(node: &mut Value) {
    if !node["spec"].is_object() {
        node["spec"] = json!({});
    }
    let taints = node["spec"].as_object_mut().expect("spec is an object").entry("taints").or_insert(json!([]));
    if !taints.is_array() {
        *taints = json!([]);
    }
    let list = taints.as_array_mut().expect("an array");
    if !list.iter().any(|t| t["key"] == NOT_READY && t["effect"] == "NoSchedule") {
        list.push(json!({ "key": NOT_READY, "effect": "NoSchedule" }));
    }
}
