//! The stand-in is as strict as a real kube-apiserver for what vip uses: each
//! scenario sends the same requests to the in-process stand-in (`NAME::stand_in`)
//! and to a real kube-apiserver (`NAME::real`, skipped without
//! `KUBEBUILDER_ASSETS` unless CI=true) and asserts the same outcome on both: the
//! status code, the reason, and each cause's reason and field path.
//!
//! - Services: `nodePort` and `healthCheckNodePort` in 30000-32767 and unique,
//!   allocated for LoadBalancers (not with `allocateLoadBalancerNodePorts: false`)
//!   and, with `externalTrafficPolicy: Local`, a `healthCheckNodePort`, refused on
//!   other types and policies, immutable, released with the policy or the type;
//! - `clusterIP` allocated in the service range, unique, immutable except to and
//!   from ExternalName, kept when an update leaves it out;
//! - `ipFamilyPolicy`/`ipFamilies` on an IPv4-only cluster: defaulted, PreferDualStack
//!   kept with one family, RequireDualStack and IPv6 refused naming the field;
//!   on a dual-stack cluster: defaulted per policy with a clusterIP per family,
//!   SingleStack upgraded to PreferDualStack and back, the primary family fixed;
//! - Nodes: admission's `node.kubernetes.io/not-ready:NoSchedule` taint on every
//!   new Node until the node controller (here the test) lifts it;
//! - VipPools: deploy/crd.yaml's structural schema (types, required, enums,
//!   minimum/maximum, lengths, item counts, patterns, formats, nulls), unknown
//!   fields pruned with a warning, defaults filled in, status writes checked as well;
//! - VipStatuses: server-side apply of the status (what the agents' writers rely
//!   on): `fieldManager` required, conflicts without `force`, a forced apply taking
//!   every field it names (nulls included), fields a manager stops naming removed,
//!   the CRD's schema checked on the applied status.
use http::Method;
use serde_json::{json, Value};
use vip_tests::{
    apiserver::{NODE_PORTS, NOT_READY},
    kubeapi::{raw, Backend},
    kubefix::lift_not_ready_taint,
};

vip_tests::both_api_servers!(node_ports_are_in_range_unique_and_allocated);
vip_tests::both_api_servers!(health_check_node_ports_follow_type_and_policy);
vip_tests::both_api_servers!(cluster_ips_are_allocated_and_immutable);
vip_tests::both_api_servers!(new_nodes_are_tainted_not_ready_until_lifted);
vip_tests::both_api_servers!(ip_families_on_a_single_stack_cluster);
vip_tests::both_api_servers!(ip_families_on_a_dual_stack_cluster, Stack::Dual);
vip_tests::both_api_servers!(vip_pools_are_checked_against_the_crd_schema);
vip_tests::both_api_servers!(vip_status_status_is_server_side_applied);
vip_tests::both_api_servers!(causes_are_worded_as_the_real_servers);

const SVCS: &str = "/api/v1/namespaces/shop/services";
const POOLS: &str = "/apis/vip.dev/v1alpha1/vippools";
const RANGE: &str = "provided port is not in the valid range. The range of valid ports is 30000-32767";

/// One response, as far as the servers are compared.
#[derive(Debug)]
struct Out {
    code: u16,
    reason: String,
    message: String,
    /// (reason, field) of every cause, sorted: the real server's order is not stable.
    causes: Vec<(String, String)>,
    warnings: Vec<String>,
    body: Value,
}

impl Out {
    /// The object written (2xx).
    #[track_caller]
    fn ok(&self) -> &Value {
        assert!((200..300).contains(&self.code), "expected success, got {} {}", self.code, self.body);
        &self.body
    }

    /// A rejection: code, reason and exactly these causes (reason, field).
    #[track_caller]
    fn rejected(&self, code: u16, reason: &str, causes: &[(&str, &str)]) -> &Self {
        let mut want: Vec<(String, String)> = causes.iter().map(|(r, f)| (r.to_string(), f.to_string())).collect();
        want.sort();
        assert_eq!((self.code, self.reason.as_str(), &self.causes), (code, reason, &want), "{}", self.body);
        self
    }

    /// A 422 Invalid with these causes.
    #[track_caller]
    fn invalid(&self, causes: &[(&str, &str)]) -> &Self {
        self.rejected(422, "Invalid", causes)
    }

    #[track_caller]
    fn says(&self, text: &str) -> &Self {
        assert!(self.message.contains(text), "{:?} does not contain {text:?}", self.message);
        self
    }
}

async fn send(c: &kube::Client, method: Method, path: &str, body: Value) -> Out {
    let ct = if method == Method::PATCH { "application/merge-patch+json" } else { "application/json" };
    send_as(c, method, path, ct, body).await
}

async fn send_as(c: &kube::Client, method: Method, path: &str, ct: &str, body: Value) -> Out {
    let body = (!body.is_null()).then_some(body);
    let r = raw(c, method.clone(), path, ct, body.as_ref()).await.unwrap_or_else(|e| panic!("{method} {path}: {e:#}"));
    let mut causes: Vec<(String, String)> = r.body["details"]["causes"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|c| Some((c["reason"].as_str().unwrap_or("").to_owned(), c["field"].as_str()?.to_owned())))
        .collect();
    causes.sort();
    let (reason, message) = if r.body["kind"] == "Status" {
        (r.body["reason"].as_str().unwrap_or("").to_owned(), r.body["message"].as_str().unwrap_or("").to_owned())
    } else {
        Default::default()
    };
    Out { code: r.status, reason, message, causes, warnings: r.warnings, body: r.body }
}

const STATUSES: &str = "/apis/vip.dev/v1alpha1/vipstatuses";

/// A server-side apply of `status` to VipStatus `name` (query: `fieldManager=...&force=...`).
async fn apply_status(c: &kube::Client, name: &str, query: &str, status: Value) -> Out {
    let body = json!({ "apiVersion": "vip.dev/v1alpha1", "kind": "VipStatus", "metadata": { "name": name }, "status": status });
    send_as(c, Method::PATCH, &format!("{STATUSES}/{name}/status?{query}"), "application/apply-patch+yaml", body).await
}

/// What the holders' and the controller's writers do (`vip_agent::k8s::vipstatus`):
/// each applies every field, with force; the last one's values are the status.
async fn vip_status_status_is_server_side_applied(api: Backend) {
    let c = api.client().await;
    let name = "198-18-1-10";
    let created = send(
        &c,
        Method::POST,
        STATUSES,
        json!({ "apiVersion": "vip.dev/v1alpha1", "kind": "VipStatus", "metadata": { "name": name }, "spec": { "address": "198.18.1.10" } }),
    )
    .await;
    assert_eq!(created.ok()["spec"]["address"], "198.18.1.10");
    let a = json!({ "holder": "node-a", "interface": "eth1", "vlan": 30, "heldSince": "2025-01-01T00:00:00Z", "lastGratuitousArp": "2025-01-01T00:00:01Z", "backends": ["node-a", "node-b"], "conditions": [] });
    apply_status(&c, name, "force=true", a.clone()).await.invalid(&[("FieldValueRequired", "fieldManager")]);
    apply_status(&c, "198-18-1-11", "fieldManager=node-a&force=true", a.clone()).await.rejected(404, "NotFound", &[]);
    assert_eq!(apply_status(&c, name, "fieldManager=node-a&force=true", a.clone()).await.ok()["status"], a);
    // Another manager, different values, no force: a conflict per field, nothing written.
    let b = json!({ "holder": "node-b", "interface": "eth1", "vlan": null, "heldSince": "2025-01-02T00:00:00Z", "lastGratuitousArp": null, "backends": ["node-a", "node-b"], "conditions": [] });
    apply_status(&c, name, "fieldManager=node-b", b.clone()).await.rejected(
        409,
        "Conflict",
        &[
            ("FieldManagerConflict", ".status.heldSince"),
            ("FieldManagerConflict", ".status.holder"),
            ("FieldManagerConflict", ".status.lastGratuitousArp"),
            ("FieldManagerConflict", ".status.vlan"),
        ],
    );
    assert_eq!(api.get("vipstatuses.vip.dev", None, name).unwrap()["status"], a);
    // Forced: every field named is node-b's, nulls included.
    assert_eq!(apply_status(&c, name, "fieldManager=node-b&force=true", b.clone()).await.ok()["status"], b);
    // Values node-b left as they were (interface, backends) are shared with node-a:
    // one node-b stops naming stays, node-a's.
    let mut fewer = b.clone();
    fewer.as_object_mut().unwrap().remove("backends");
    assert_eq!(apply_status(&c, name, "fieldManager=node-b&force=true", fewer.clone()).await.ok()["status"], b);
    // node-a stops naming it too: it goes (back to the schema's default); what
    // node-b owns stays.
    let mut mixed = fewer.clone();
    mixed["holder"] = "node-a".into();
    mixed["backends"] = json!([]);
    assert_eq!(apply_status(&c, name, "fieldManager=node-a&force=true", json!({ "holder": "node-a" })).await.ok()["status"], mixed);
    // The schema holds for applied statuses.
    apply_status(&c, name, "fieldManager=node-a&force=true", json!({ "vlan": 5000 })).await.invalid(&[("FieldValueInvalid", "status.vlan")]);
    assert_eq!(api.get("vipstatuses.vip.dev", None, name).unwrap()["status"], mixed);
    send(&c, Method::DELETE, &format!("{STATUSES}/{name}"), Value::Null).await.ok();
}

fn service(name: &str, spec: Value) -> Value {
    json!({ "apiVersion": "v1", "kind": "Service", "metadata": { "name": name, "namespace": "shop" }, "spec": spec })
}

/// A LoadBalancer Service on port 80 with `extra` fields in its spec.
fn lb(name: &str, extra: Value) -> Value {
    let mut spec = json!({ "type": "LoadBalancer", "ports": [{ "port": 80 }] });
    spec.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
    service(name, spec)
}

fn node_port(svc: &Value, i: usize) -> i64 {
    svc["spec"]["ports"][i]["nodePort"].as_i64().unwrap_or_else(|| panic!("no nodePort on port {i}: {svc}"))
}

fn hcnp(svc: &Value) -> Option<i64> {
    svc["spec"]["healthCheckNodePort"].as_i64()
}

/// nodePorts: allocated for NodePort and LoadBalancer Services (one per port number,
/// shared by its protocols), none with `allocateLoadBalancerNodePorts: false`;
/// requests outside the range or taken refused (422, the port's field); none on
/// ClusterIP; kept when an update leaves them out; dropped with the type; freed
/// with the Service.
async fn node_ports_are_in_range_unique_and_allocated(api: Backend) {
    let c = api.client().await;
    let ports = json!([{ "name": "web", "port": 80 }, { "name": "dns", "port": 53, "protocol": "UDP" }, { "name": "dns-tcp", "port": 53, "protocol": "TCP" }]);
    let a = send(&c, Method::POST, SVCS, service("np-a", json!({ "type": "LoadBalancer", "ports": ports }))).await.ok().clone();
    let (web, dns) = (node_port(&a, 0), node_port(&a, 1));
    assert!(NODE_PORTS.contains(&web) && NODE_PORTS.contains(&dns) && web != dns, "{a}");
    assert_eq!(node_port(&a, 2), dns, "one nodePort per port number: {a}");
    assert_eq!((&a["spec"]["allocateLoadBalancerNodePorts"], &a["spec"]["externalTrafficPolicy"]), (&json!(true), &json!("Cluster")), "defaults");
    assert_eq!(hcnp(&a), None, "no healthCheckNodePort with Cluster policy");

    let no_alloc =
        send(&c, Method::POST, SVCS, service("np-none", json!({ "type": "LoadBalancer", "allocateLoadBalancerNodePorts": false, "ports": [{ "port": 80 }] })))
            .await;
    assert_eq!(no_alloc.ok()["spec"]["ports"][0].get("nodePort"), None, "{}", no_alloc.body);

    let np = |name: &str, ports: Value| service(name, json!({ "type": "NodePort", "ports": ports }));
    send(&c, Method::POST, SVCS, np("np-low", json!([{ "port": 80, "nodePort": 80 }])))
        .await
        .invalid(&[("FieldValueInvalid", "spec.ports[0].nodePort")])
        .says(RANGE);
    send(&c, Method::POST, SVCS, np("np-high", json!([{ "port": 80, "nodePort": 32768 }])))
        .await
        .invalid(&[("FieldValueInvalid", "spec.ports[0].nodePort")])
        .says(RANGE);
    send(&c, Method::POST, SVCS, np("np-taken", json!([{ "port": 80, "nodePort": web }])))
        .await
        .invalid(&[("FieldValueInvalid", "spec.ports[0].nodePort")])
        .says(&format!("Invalid value: {web}: provided port is already allocated"));
    let twice = json!([{ "name": "a", "port": 80, "nodePort": 32100 }, { "name": "b", "port": 81, "nodePort": 32100 }]);
    send(&c, Method::POST, SVCS, np("np-twice", twice)).await.invalid(&[("FieldValueInvalid", "spec.ports[1].nodePort")]).says("already allocated");
    send(&c, Method::POST, SVCS, service("np-cip", json!({ "ports": [{ "port": 80, "nodePort": 32101 }] })))
        .await
        .invalid(&[("FieldValueForbidden", "spec.ports[0].nodePort")])
        .says("may not be used when `type` is 'ClusterIP'");
    // The refused requests took nothing: 32100 is still free.
    send(&c, Method::POST, SVCS, np("np-static", json!([{ "port": 80, "nodePort": 32100 }]))).await.ok();

    // A replace that leaves the nodePorts out keeps them (by port name).
    let mut body = a.clone();
    for p in body["spec"]["ports"].as_array_mut().unwrap() {
        p.as_object_mut().unwrap().remove("nodePort");
    }
    let kept = send(&c, Method::PUT, &format!("{SVCS}/np-a"), body).await.ok().clone();
    assert_eq!((node_port(&kept, 0), node_port(&kept, 1), node_port(&kept, 2)), (web, dns, dns), "{kept}");
    // Another Service's port, asked for on update, is refused.
    let take = json!({ "spec": { "ports": [{ "name": "web", "port": 80, "nodePort": 32100 }, { "name": "dns", "port": 53, "protocol": "UDP" }, { "name": "dns-tcp", "port": 53, "protocol": "TCP" }] } });
    send(&c, Method::PATCH, &format!("{SVCS}/np-a"), take).await.invalid(&[("FieldValueInvalid", "spec.ports[0].nodePort")]).says("already allocated");

    // Away from LoadBalancer the nodePorts go (and the fields only LoadBalancers have)...
    let cip = send(&c, Method::PATCH, &format!("{SVCS}/np-a"), json!({ "spec": { "type": "ClusterIP" } })).await.ok().clone();
    assert!(cip["spec"]["ports"].as_array().unwrap().iter().all(|p| p.get("nodePort").is_none()), "{cip}");
    for f in ["externalTrafficPolicy", "allocateLoadBalancerNodePorts", "healthCheckNodePort"] {
        assert_eq!(cip["spec"].get(f), None, "{f}: {cip}");
    }
    // ...and are free again; so are a deleted Service's.
    send(&c, Method::POST, SVCS, np("np-reuse", json!([{ "port": 80, "nodePort": web }]))).await.ok();
    send(&c, Method::DELETE, &format!("{SVCS}/np-static"), Value::Null).await.ok();
    send(&c, Method::POST, SVCS, np("np-after-delete", json!([{ "port": 80, "nodePort": 32100 }]))).await.ok();
}

/// healthCheckNodePort: allocated for a LoadBalancer with Local policy; a requested
/// one out of range or taken is a 500 from the healthCheckNodePort allocator (the
/// real server's answer, no field); refused (422) on Cluster policy and other types;
/// immutable; dropped (and freed) when the policy goes back to Cluster; allocated
/// when it changes to Local.
async fn health_check_node_ports_follow_type_and_policy(api: Backend) {
    let c = api.client().await;
    let lb = |name: &str, extra: Value| {
        let mut spec = json!({ "type": "LoadBalancer", "externalTrafficPolicy": "Local", "ports": [{ "port": 80 }] });
        spec.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
        service(name, spec)
    };
    let a = send(&c, Method::POST, SVCS, lb("hc-a", json!({}))).await.ok().clone();
    let hc = hcnp(&a).unwrap_or_else(|| panic!("no healthCheckNodePort allocated: {a}"));
    assert!(NODE_PORTS.contains(&hc) && hc != node_port(&a, 0), "{a}");
    let b = send(&c, Method::POST, SVCS, lb("hc-b", json!({ "allocateLoadBalancerNodePorts": false }))).await.ok().clone();
    assert!(hcnp(&b).is_some_and(|p| p != hc) && b["spec"]["ports"][0].get("nodePort").is_none(), "{b}");
    let given = send(&c, Method::POST, SVCS, lb("hc-given", json!({ "healthCheckNodePort": 32000 }))).await.ok().clone();
    assert_eq!(hcnp(&given), Some(32000));

    send(&c, Method::POST, SVCS, lb("hc-80", json!({ "healthCheckNodePort": 80 })))
        .await
        .rejected(500, "InternalError", &[])
        .says(&format!("failed to allocate requested HealthCheck NodePort 80: {RANGE}"));
    send(&c, Method::POST, SVCS, lb("hc-taken", json!({ "healthCheckNodePort": node_port(&a, 0) })))
        .await
        .rejected(500, "InternalError", &[])
        .says("provided port is already allocated");
    let not_here = "may only be set when `type` is 'LoadBalancer' and `externalTrafficPolicy` is 'Local'";
    send(&c, Method::POST, SVCS, lb("hc-cluster", json!({ "externalTrafficPolicy": "Cluster", "healthCheckNodePort": 32001 })))
        .await
        .invalid(&[("FieldValueInvalid", "spec.healthCheckNodePort")])
        .says(not_here);
    send(&c, Method::POST, SVCS, service("hc-cip", json!({ "healthCheckNodePort": 32002, "ports": [{ "port": 80 }] })))
        .await
        .invalid(&[("FieldValueInvalid", "spec.healthCheckNodePort")])
        .says(not_here);
    send(&c, Method::POST, SVCS, service("hc-etp", json!({ "externalTrafficPolicy": "Local", "ports": [{ "port": 80 }] })))
        .await
        .invalid(&[("FieldValueInvalid", "spec.externalTrafficPolicy")])
        .says("may only be set for externally-accessible services");

    let a_path = format!("{SVCS}/hc-a");
    for to in [32003, 80] {
        send(&c, Method::PATCH, &a_path, json!({ "spec": { "healthCheckNodePort": to } }))
            .await
            .invalid(&[("FieldValueForbidden", "spec.healthCheckNodePort")])
            .says("field is immutable");
    }
    // Back to Cluster: the port goes and is free again; to Local again: a new one.
    let cluster = send(&c, Method::PATCH, &a_path, json!({ "spec": { "externalTrafficPolicy": "Cluster" } })).await.ok().clone();
    assert_eq!(hcnp(&cluster), None, "{cluster}");
    send(&c, Method::POST, SVCS, service("hc-reuse", json!({ "type": "NodePort", "ports": [{ "port": 80, "nodePort": hc }] }))).await.ok();
    send(&c, Method::PATCH, &a_path, json!({ "spec": { "externalTrafficPolicy": "Local", "healthCheckNodePort": 80 } }))
        .await
        .rejected(500, "InternalError", &[])
        .says(RANGE);
    let local = send(&c, Method::PATCH, &a_path, json!({ "spec": { "externalTrafficPolicy": "Local" } })).await.ok().clone();
    assert!(hcnp(&local).is_some_and(|p| NODE_PORTS.contains(&p) && p != hc), "{local}");
}

/// clusterIP: allocated in the service range (10.96.0.0/16 on both servers), unique,
/// immutable, kept when an update leaves it out, dropped for ExternalName and
/// allocated again when coming back from it.
async fn cluster_ips_are_allocated_and_immutable(api: Backend) {
    let c = api.client().await;
    let a = send(&c, Method::POST, SVCS, service("ip-a", json!({ "ports": [{ "port": 80 }] }))).await.ok().clone();
    let ip = a["spec"]["clusterIP"].as_str().unwrap_or_else(|| panic!("no clusterIP: {a}")).to_owned();
    assert!(ip.starts_with("10.96."), "{a}");
    assert_eq!(a["spec"]["clusterIPs"], json!([ip]));
    assert_eq!((&a["spec"]["ipFamilies"], &a["spec"]["ipFamilyPolicy"], &a["spec"]["type"]), (&json!(["IPv4"]), &json!("SingleStack"), &json!("ClusterIP")));

    let path = format!("{SVCS}/ip-a");
    send(&c, Method::PATCH, &path, json!({ "spec": { "clusterIP": "10.96.200.200" } }))
        .await
        .invalid(&[("FieldValueInvalid", "spec.clusterIPs[0]")])
        .says("may not change once set");
    let mut body = a.clone();
    body["spec"].as_object_mut().unwrap().retain(|k, _| k != "clusterIP" && k != "clusterIPs");
    assert_eq!(send(&c, Method::PUT, &path, body).await.ok()["spec"]["clusterIP"], json!(ip), "a replace without it keeps it");

    let with_ip = |name: &str, t: &str, ip: &str| service(name, json!({ "type": t, "clusterIP": ip, "ports": [{ "port": 80 }] }));
    send(&c, Method::POST, SVCS, with_ip("ip-out", "ClusterIP", "10.1.0.5"))
        .await
        .invalid(&[("FieldValueInvalid", "spec.clusterIPs")])
        .says("failed to allocate IP 10.1.0.5: the provided network does not match the current range");
    send(&c, Method::POST, SVCS, with_ip("ip-taken", "ClusterIP", &ip))
        .await
        .invalid(&[("FieldValueInvalid", "spec.clusterIPs")])
        .says("provided IP is already allocated");
    send(&c, Method::POST, SVCS, with_ip("ip-bad", "ClusterIP", "foo"))
        .await
        .invalid(&[("FieldValueInvalid", "spec.clusterIPs[0]")])
        .says("must be a valid IP address");
    send(&c, Method::POST, SVCS, with_ip("ip-none", "LoadBalancer", "None"))
        .await
        .invalid(&[("FieldValueInvalid", "spec.clusterIPs[0]")])
        .says("may not be set to 'None' for LoadBalancer services");
    send(&c, Method::POST, SVCS, with_ip("ip-static", "ClusterIP", "10.96.0.77")).await.ok();

    // To ExternalName and back: the address goes, then a new one comes.
    let ext = send(&c, Method::PATCH, &path, json!({ "spec": { "type": "ExternalName", "externalName": "example.com" } })).await.ok().clone();
    assert_eq!((ext["spec"].get("clusterIP"), ext["spec"].get("clusterIPs")), (None, None), "{ext}");
    send(&c, Method::POST, SVCS, service("ip-ext", json!({ "type": "ExternalName", "clusterIP": "10.96.0.78" })))
        .await
        .invalid(&[("FieldValueForbidden", "spec.clusterIPs"), ("FieldValueRequired", "spec.externalName")]);
    let back = send(&c, Method::PATCH, &path, json!({ "spec": { "type": "ClusterIP", "externalName": null } })).await.ok().clone();
    assert!(back["spec"]["clusterIP"].as_str().is_some_and(|b| b.starts_with("10.96.")), "{back}");
}

/// `spec.ipFamilyPolicy` and `spec.ipFamilies` on the tests' IPv4-only cluster:
/// defaulted to SingleStack and the cluster's family, PreferDualStack kept with
/// IPv4 only, RequireDualStack and IPv6 refused (vip's allocator takes the
/// families as the server leaves them).
async fn ip_families_on_a_single_stack_cluster(api: Backend) {
    let c = api.client().await;
    let made = |o: &Out| (o.ok()["spec"]["ipFamilies"].clone(), o.ok()["spec"]["ipFamilyPolicy"].clone());
    let o = send(&c, Method::POST, SVCS, lb("fam-default", json!({}))).await;
    assert_eq!(made(&o), (json!(["IPv4"]), json!("SingleStack")));
    let o = send(&c, Method::POST, SVCS, lb("fam-prefer", json!({ "ipFamilyPolicy": "PreferDualStack" }))).await;
    assert_eq!(made(&o), (json!(["IPv4"]), json!("PreferDualStack")), "kept, with the one family there is");
    let refused: [(&str, Value, &str, &str, &str); 6] = [
        (
            "fam-prefer-both",
            json!({ "ipFamilyPolicy": "PreferDualStack", "ipFamilies": ["IPv4", "IPv6"] }),
            "FieldValueInvalid",
            "spec.ipFamilies[1]",
            "not configured on this cluster",
        ),
        (
            "fam-require",
            json!({ "ipFamilyPolicy": "RequireDualStack" }),
            "FieldValueInvalid",
            "spec.ipFamilyPolicy",
            "this cluster is not configured for dual-stack services",
        ),
        ("fam-v6", json!({ "ipFamilies": ["IPv6"] }), "FieldValueInvalid", "spec.ipFamilies[0]", "not configured on this cluster"),
        (
            "fam-single-two",
            json!({ "ipFamilyPolicy": "SingleStack", "ipFamilies": ["IPv4", "IPv6"] }),
            "FieldValueInvalid",
            "spec.ipFamilyPolicy",
            "must be 'RequireDualStack' or 'PreferDualStack' when multiple IP families are specified",
        ),
        ("fam-bad", json!({ "ipFamilies": ["IPv5"] }), "FieldValueNotSupported", "spec.ipFamilies[0]", "supported values: \"IPv4\", \"IPv6\""),
        (
            "fam-bad-policy",
            json!({ "ipFamilyPolicy": "Sometimes" }),
            "FieldValueNotSupported",
            "spec.ipFamilyPolicy",
            "supported values: \"PreferDualStack\", \"RequireDualStack\", \"SingleStack\"",
        ),
    ];
    for (name, extra, reason, field, text) in refused {
        send(&c, Method::POST, SVCS, lb(name, extra)).await.invalid(&[(reason, field)]).says(text);
    }
}

/// `spec.ipFamilyPolicy` and `spec.ipFamilies` on a dual-stack cluster (IPv4
/// primary): what a Service is given, by policy and families asked for (a clusterIP
/// of each family, in `ipFamilies`' order; no policy is SingleStack, also with two
/// families, which is refused); SingleStack may become PreferDualStack (upgraded: the
/// second family and clusterIP added) and back (downgraded: the secondary goes), the
/// primary family never changes (its clusterIP would not match). vip's allocator serves the families as the server
/// leaves them (k8s_dualstack.rs).
async fn ip_families_on_a_dual_stack_cluster(api: Backend) {
    let c = api.client().await;
    // (ipFamilies, ipFamilyPolicy, the family of each clusterIP), checked against each other.
    let made = |o: &Out| {
        let spec = &o.ok()["spec"];
        let ips: Vec<&str> = spec["clusterIPs"].as_array().unwrap().iter().map(|i| i.as_str().unwrap()).collect();
        assert_eq!(spec["clusterIP"], ips[0], "{spec}");
        for ip in &ips {
            assert!(ip.starts_with("10.96.") || ip.starts_with("fd00:10:96::"), "in the service CIDRs: {spec}");
        }
        let fams: Vec<&str> = ips.iter().map(|i| if i.contains(':') { "IPv6" } else { "IPv4" }).collect();
        assert_eq!(spec["ipFamilies"], json!(fams), "a clusterIP of each family, in order: {spec}");
        (spec["ipFamilies"].clone(), spec["ipFamilyPolicy"].clone())
    };
    let given: [(&str, Value, Value, &str); 7] = [
        ("fam-default", json!({}), json!(["IPv4"]), "SingleStack"),
        ("fam-prefer", json!({ "ipFamilyPolicy": "PreferDualStack" }), json!(["IPv4", "IPv6"]), "PreferDualStack"),
        ("fam-prefer-v6", json!({ "ipFamilyPolicy": "PreferDualStack", "ipFamilies": ["IPv6"] }), json!(["IPv6", "IPv4"]), "PreferDualStack"),
        ("fam-require", json!({ "ipFamilyPolicy": "RequireDualStack" }), json!(["IPv4", "IPv6"]), "RequireDualStack"),
        ("fam-require-64", json!({ "ipFamilyPolicy": "RequireDualStack", "ipFamilies": ["IPv6", "IPv4"] }), json!(["IPv6", "IPv4"]), "RequireDualStack"),
        ("fam-v6", json!({ "ipFamilies": ["IPv6"] }), json!(["IPv6"]), "SingleStack"),
        ("fam-v6-ip", json!({ "clusterIP": "fd00:10:96::99" }), json!(["IPv6"]), "SingleStack"),
    ];
    for (name, extra, fams, policy) in given {
        let o = send(&c, Method::POST, SVCS, lb(name, extra)).await;
        assert_eq!(made(&o), (fams, json!(policy)), "{name}");
    }
    let two = "must be 'RequireDualStack' or 'PreferDualStack' when multiple IP families are specified";
    send(&c, Method::POST, SVCS, lb("fam-two", json!({ "ipFamilies": ["IPv4", "IPv6"] })))
        .await
        .invalid(&[("FieldValueInvalid", "spec.ipFamilyPolicy")])
        .says(two);
    send(&c, Method::POST, SVCS, lb("fam-single-two", json!({ "ipFamilyPolicy": "SingleStack", "ipFamilies": ["IPv4", "IPv6"] })))
        .await
        .invalid(&[("FieldValueInvalid", "spec.ipFamilyPolicy")])
        .says(two);

    // Upgraded and downgraded by the policy alone; the primary family stays.
    let path = format!("{SVCS}/fam-default");
    let policy = |p: &str| json!({ "spec": { "ipFamilyPolicy": p } });
    assert_eq!(made(&send(&c, Method::PATCH, &path, policy("PreferDualStack")).await), (json!(["IPv4", "IPv6"]), json!("PreferDualStack")));
    assert_eq!(made(&send(&c, Method::PATCH, &path, policy("RequireDualStack")).await), (json!(["IPv4", "IPv6"]), json!("RequireDualStack")));
    assert_eq!(made(&send(&c, Method::PATCH, &path, policy("SingleStack")).await), (json!(["IPv4"]), json!("SingleStack")));
    // The primary family cannot change: its clusterIP would not match.
    send(&c, Method::PATCH, &path, json!({ "spec": { "ipFamilies": ["IPv6"] } }))
        .await
        .invalid(&[("FieldValueInvalid", "spec.clusterIPs[0]")])
        .says("expected an IPv6 value as indicated by `ipFamilies[0]`");
    send(&c, Method::POST, SVCS, lb("fam-twice", json!({ "ipFamilyPolicy": "RequireDualStack", "ipFamilies": ["IPv4", "IPv4"] })))
        .await
        .invalid(&[("FieldValueDuplicate", "spec.ipFamilies[1]")]);
    send(&c, Method::PATCH, &format!("{SVCS}/fam-require"), json!({ "spec": { "ipFamilies": ["IPv4"] } }))
        .await
        .invalid(&[("FieldValueInvalid", "spec.ipFamilyPolicy")])
        .says("must be 'SingleStack' to release the secondary IP family");
}

/// Every Node created through the API gets `node.kubernetes.io/not-ready:NoSchedule`
/// (added to other taints, not doubled); lifting it (as the node controller does)
/// holds, since admission only acts on create; a Node keeps the status it was
/// created with.
async fn new_nodes_are_tainted_not_ready_until_lifted(api: Backend) {
    let c = api.client().await;
    let names = ["strict-plain", "strict-tainted", "strict-has-it", "strict-ready"];
    for n in names {
        let _ = raw(&c, Method::DELETE, &format!("/api/v1/nodes/{n}"), "", None).await;
    }
    let node = |name: &str, extra: Value| {
        let mut n = json!({ "apiVersion": "v1", "kind": "Node", "metadata": { "name": name } });
        n.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
        n
    };
    let taints = |n: &Value| n["spec"]["taints"].clone();
    let not_ready = json!({ "key": NOT_READY, "effect": "NoSchedule" });
    let plain = send(&c, Method::POST, "/api/v1/nodes", node(names[0], json!({}))).await.ok().clone();
    assert_eq!(taints(&plain), json!([not_ready]));
    let other = json!({ "key": "example.com/maintenance", "effect": "NoExecute" });
    let tainted = send(&c, Method::POST, "/api/v1/nodes", node(names[1], json!({ "spec": { "taints": [other] } }))).await.ok().clone();
    assert_eq!(taints(&tainted), json!([other, not_ready]));
    let own = json!({ "key": NOT_READY, "value": "own", "effect": "NoSchedule" });
    let has_it = send(&c, Method::POST, "/api/v1/nodes", node(names[2], json!({ "spec": { "taints": [own] } }))).await.ok().clone();
    assert_eq!(taints(&has_it), json!([own]), "one of that key and effect is enough");
    let ready = json!({ "conditions": [{ "type": "Ready", "status": "True" }] });
    let with_status = send(&c, Method::POST, "/api/v1/nodes", node(names[3], json!({ "status": ready }))).await.ok().clone();
    assert_eq!((taints(&with_status), &with_status["status"]["conditions"][0]["status"]), (json!([not_ready]), &json!("True")), "{with_status}");

    let lifted = lift_not_ready_taint(&c, names[0]).await.unwrap();
    assert_eq!(lifted["spec"].get("taints"), None, "{lifted}");
    let relabelled = send(&c, Method::PATCH, &format!("/api/v1/nodes/{}", names[0]), json!({ "metadata": { "labels": { "a": "b" } } })).await.ok().clone();
    assert_eq!(relabelled["spec"].get("taints"), None, "admission taints on create only: {relabelled}");
    assert_eq!(taints(&lift_not_ready_taint(&c, names[1]).await.unwrap()), json!([other]));
    for n in names {
        let _ = raw(&c, Method::DELETE, &format!("/api/v1/nodes/{n}"), "", None).await;
    }
}

/// VipPools against deploy/crd.yaml: every violation one cause with its field (and
/// the real server's quirk of a field-less cause for a fraction in an int64); nulls
/// of non-nullable fields dropped and defaulted; unknown fields pruned with a
/// `Warning`; defaults filled in; the status subresource checked against the status
/// schema; a refused update changes nothing.
async fn vip_pools_are_checked_against_the_crd_schema(api: Backend) {
    let c = api.client().await;
    let pool = |name: &str, spec: Value| json!({ "apiVersion": "vip.dev/v1alpha1", "kind": "VipPool", "metadata": { "name": name }, "spec": spec });
    let bad = json!({
        "addresses": "198.18.1.0/24", "announce": "bgp", "tableSize": -1, "autoAssign": "yes",
        "healthCheck": { "fall": "3", "port": 70000 }, "gratuitousArp": { "count": 1.5 }, "nodeSelector": { "a": 1 },
    });
    send(&c, Method::POST, POOLS, pool("bad", bad))
        .await
        .invalid(&[
            ("FieldValueTypeInvalid", "spec.addresses"),
            ("FieldValueNotSupported", "spec.announce"),
            ("FieldValueInvalid", "spec.tableSize"),
            ("FieldValueTypeInvalid", "spec.autoAssign"),
            ("FieldValueTypeInvalid", "spec.healthCheck.fall"),
            ("FieldValueInvalid", "spec.healthCheck.port"),
            ("FieldValueRequired", "spec.healthCheck.type"),
            ("FieldValueTypeInvalid", "spec.gratuitousArp.count"),
            ("FieldValueInvalid", "<nil>"),
            ("FieldValueTypeInvalid", "spec.nodeSelector.a"),
        ])
        .says("VipPool.vip.dev \"bad\" is invalid: [")
        .says("spec.announce: Unsupported value: \"bgp\": supported values: \"arp\", \"lo\"")
        .says("spec.healthCheck.port: Invalid value: 70000: spec.healthCheck.port in body should be less than or equal to 65535")
        .says("spec.addresses: Invalid value: \"string\": spec.addresses in body must be of type array: \"string\"");
    send(&c, Method::POST, POOLS, json!({ "apiVersion": "vip.dev/v1alpha1", "kind": "VipPool", "metadata": { "name": "nospec" } }))
        .await
        .invalid(&[("FieldValueRequired", "spec")]);
    send(&c, Method::POST, POOLS, pool("items", json!({ "addresses": [null, 5] })))
        .await
        .invalid(&[("FieldValueTypeInvalid", "spec.addresses[0]"), ("FieldValueTypeInvalid", "spec.addresses[1]")]);
    // Interface names: a '/', ':' or whitespace, empty, over 15 characters (one cause
    // each, the length first), more than 16 of them; well-formed ones kept as written.
    let ifaces = json!(["eth0/1", "", "abcdefghijklmnop", "eth 0", "eth0:1", "abcdefghijklmno/", "eth0.100"]);
    send(&c, Method::POST, POOLS, pool("ifaces", json!({ "addresses": ["198.18.1.10"], "interfaces": ifaces })))
        .await
        .invalid(&[
            ("FieldValueInvalid", "spec.interfaces[0]"),
            ("FieldValueInvalid", "spec.interfaces[1]"),
            ("FieldValueTooLong", "spec.interfaces[2]"),
            ("FieldValueInvalid", "spec.interfaces[3]"),
            ("FieldValueInvalid", "spec.interfaces[4]"),
            ("FieldValueTooLong", "spec.interfaces[5]"),
        ])
        .says(r#"spec.interfaces[0]: Invalid value: "eth0/1": spec.interfaces[0] in body should match '^[^/:[:space:]]+$'"#);
    let many: Vec<String> = (0..17).map(|i| format!("eth{i}")).collect();
    send(&c, Method::POST, POOLS, pool("ifaces", json!({ "addresses": ["198.18.1.10"], "interfaces": many })))
        .await
        .invalid(&[("FieldValueTooMany", "spec.interfaces")]);
    let kept = json!(["eth1", "ens4.100", "abcdefghijklmno", "éééééééé"]);
    let ok = send(&c, Method::POST, POOLS, pool("ifaces", json!({ "addresses": ["198.18.1.10"], "interfaces": kept }))).await.ok().clone();
    assert_eq!(ok["spec"]["interfaces"], kept, "{ok}");
    send(&c, Method::DELETE, &format!("{POOLS}/ifaces"), Value::Null).await.ok();
    // A VLAN id: 1 to 4094, an integer.
    for (vlan, reason) in [(json!(0), "FieldValueInvalid"), (json!(4095), "FieldValueInvalid"), (json!("30"), "FieldValueTypeInvalid")] {
        send(&c, Method::POST, POOLS, pool("vlan", json!({ "addresses": ["198.18.1.10"], "vlan": vlan }))).await.invalid(&[(reason, "spec.vlan")]);
    }
    send(&c, Method::POST, POOLS, pool("vlan", json!({ "addresses": ["198.18.1.10"], "vlan": 4095 })))
        .await
        .says("spec.vlan: Invalid value: 4095: spec.vlan in body should be less than or equal to 4094");
    let ok = send(&c, Method::POST, POOLS, pool("vlan", json!({ "addresses": ["198.18.1.10"], "vlan": 30 }))).await.ok().clone();
    assert_eq!(ok["spec"]["vlan"], 30, "{ok}");
    send(&c, Method::DELETE, &format!("{POOLS}/vlan"), Value::Null).await.ok();

    // Pruned, null-dropped and defaulted.
    let spec = json!({ "addresses": ["198.18.1.10/32"], "foo": 1, "announce": null, "nodeSelector": null, "serviceSelector": null,
                       "healthCheck": { "type": "tcp", "bar": 2 } });
    let created = send(&c, Method::POST, POOLS, pool("good", spec)).await;
    let mut warnings = created.warnings.clone();
    warnings.sort();
    assert_eq!(warnings, [r#"299 - "unknown field \"spec.foo\"""#, r#"299 - "unknown field \"spec.healthCheck.bar\"""#]);
    let got = created.ok();
    let want = json!({ "addresses": ["198.18.1.10/32"], "announce": "arp", "autoAssign": true, "excludedIPs": [], "serviceSelector": null,
                       "healthCheck": { "type": "tcp", "fall": 3, "rise": 2, "interval": "1s", "timeout": "500ms" } });
    assert_eq!(got["spec"], want, "{got}");
    assert_eq!(got.get("status"), None, "status is not set on create");

    // The status subresource: the status schema, field paths from the root.
    let status_path = format!("{POOLS}/good/status");
    let bad_status = json!({ "status": { "allocated": -1, "total": "x", "zzz": 1,
        "conditions": [{ "type": "Ready", "status": "True", "reason": "R", "lastTransitionTime": "yesterday" }] } });
    send(&c, Method::PATCH, &status_path, bad_status)
        .await
        .invalid(&[
            ("FieldValueInvalid", "status.allocated"),
            ("FieldValueTypeInvalid", "status.total"),
            ("FieldValueTypeInvalid", "status.conditions[0].lastTransitionTime"),
            ("FieldValueRequired", "status.conditions[0].message"),
        ])
        .says("status.allocated: Invalid value: -1: allocated in body should be greater than or equal to 0");
    let ok_status = json!({ "status": { "owners": { "198.18.1.10": "node-1" },
        "conditions": [{ "type": "Ready", "status": "True", "reason": "R", "message": "", "lastTransitionTime": "2024-01-01T00:00:00Z" }] } });
    let st = send(&c, Method::PATCH, &status_path, ok_status).await.ok()["status"].clone();
    assert_eq!(
        (&st["total"], &st["allocated"], &st["free"], &st["owners"]),
        (&json!(0), &json!(0), &json!(0), &json!({ "198.18.1.10": "node-1" })),
        "defaults: {st}"
    );

    // A refused update leaves the pool as it was.
    let before = send(&c, Method::GET, &format!("{POOLS}/good"), Value::Null).await.ok().clone();
    send(&c, Method::PATCH, &format!("{POOLS}/good"), json!({ "spec": { "healthCheck": { "port": 4294967296i64 } } }))
        .await
        .invalid(&[("FieldValueInvalid", "spec.healthCheck.port"), ("FieldValueInvalid", "<nil>")])
        .says("Checked value must be of type integer with format int32 in spec.healthCheck.port");
    send(&c, Method::PATCH, &format!("{POOLS}/good"), json!({ "spec": { "addresses": null } })).await.invalid(&[("FieldValueRequired", "spec.addresses")]);
    let after = send(&c, Method::GET, &format!("{POOLS}/good"), Value::Null).await.ok().clone();
    assert_eq!(after["metadata"]["resourceVersion"], before["metadata"]["resourceVersion"]);
}

/// Beyond code, reason and fields: each cause's message, word for word, and the
/// warnings, for requests that do not depend on what else the servers hold. The
/// real server's answers are written down in [`WORDED`] and both servers are held
/// to them: the stand-in in every run, the real one where it is supplied.
/// `VIP_K8S_RECORD=1` with the real server writes the file anew from its answers.
async fn causes_are_worded_as_the_real_servers(api: Backend) {
    let got = worded_answers(&api.client().await).await;
    if api.is_real() && std::env::var_os("VIP_K8S_RECORD").is_some() {
        let Backend::Real { server, .. } = &api else { unreachable!() };
        let doc = json!({ "recordedFrom": format!("kube-apiserver {}", server.version()), "answers": got });
        std::fs::write(WORDED, serde_json::to_string_pretty(&doc).unwrap() + "\n").unwrap();
        eprintln!("recorded {WORDED} from kube-apiserver {}", server.version());
        return;
    }
    let want: Value = serde_json::from_str(&std::fs::read_to_string(WORDED).unwrap()).unwrap();
    let (want, got) = (want["answers"].as_array().unwrap(), got.as_array().unwrap());
    assert_eq!(want.len(), got.len(), "the cases and {WORDED} differ in number: re-record it with the real server (VIP_K8S_RECORD=1)");
    for (w, g) in want.iter().zip(got) {
        assert_eq!(w["request"], g["request"], "the cases and {WORDED} differ: re-record it with the real server (VIP_K8S_RECORD=1)");
        assert_eq!(g, w, "{} answers differently from the recorded real server ({WORDED})", if api.is_real() { "kube-apiserver" } else { "the stand-in" });
    }
}

/// The real server's answers to [`worded_answers`], as kube-apiserver v1.36.2 gave them.
const WORDED: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/fixtures/k8s/worded-causes.json");

/// Each case's request and what a server answered, as far as it is compared: code,
/// reason, message (where one cause: with several, the order is the server's),
/// the causes sorted; then a pool with unknown fields: the warnings and what is stored.
async fn worded_answers(c: &kube::Client) -> Value {
    let svc = |spec: Value| service("worded", spec);
    let pool = |spec: Value| json!({ "apiVersion": "vip.dev/v1alpha1", "kind": "VipPool", "metadata": { "name": "worded" }, "spec": spec });
    let cases = [
        (SVCS, lb("worded", json!({ "externalTrafficPolicy": "Local", "healthCheckNodePort": 80 }))),
        (SVCS, lb("worded", json!({ "healthCheckNodePort": 32001 }))),
        (SVCS, lb("worded", json!({ "ports": [{ "port": 80, "nodePort": 80 }], "healthCheckNodePort": 80, "externalTrafficPolicy": "Local" }))),
        (SVCS, lb("worded", json!({ "clusterIP": "None" }))),
        (SVCS, lb("worded", json!({ "ports": [] }))),
        (SVCS, lb("worded", json!({ "type": "NodePort", "ports": [{ "port": 80, "nodePort": 40000 }] }))),
        (SVCS, svc(json!({ "ports": [{ "port": 80, "nodePort": 32101 }], "healthCheckNodePort": 32002, "externalTrafficPolicy": "Local" }))),
        (SVCS, svc(json!({ "clusterIP": "10.1.0.5", "ports": [{ "port": 80 }] }))),
        (SVCS, svc(json!({ "clusterIP": "foo", "ports": [{ "port": 80 }] }))),
        (SVCS, svc(json!({ "type": "ExternalName", "clusterIP": "10.96.0.78" }))),
        (SVCS, svc(json!({ "ports": [{ "port": 80 }, { "port": 81 }] }))),
        (SVCS, svc(json!({ "type": "Foo", "ports": [{ "port": 0, "protocol": "XYZ" }] }))),
        (SVCS, svc(json!({ "ports": [{ "port": 80, "name": "a" }, { "port": 81, "name": "a" }] }))),
        (SVCS, svc(json!({ "ports": [{ "port": 80 }], "allocateLoadBalancerNodePorts": true, "loadBalancerClass": "x/y" }))),
        (POOLS, pool(json!({ "addresses": "x", "announce": 5, "tableSize": 99999999999i64, "autoAssign": "yes", "nodeSelector": { "a": 1 } }))),
        (POOLS, pool(json!({ "addresses": [null, 5], "healthCheck": { "fall": "3", "port": 70000, "rise": 1.5 }, "gratuitousArp": { "count": -1 } }))),
        (POOLS, pool(json!({ "addresses": [], "tolerations": [{ "key": "k", "tolerationSeconds": 1e20 }], "excludedIPs": "none" }))),
        (POOLS, pool(json!([]))),
        (POOLS, pool(json!({ "addresses": [], "interfaces": ["eth0/1", "", "abcdefghijklmnop", "eth 0", "eth0:1", "eth\u{b}0", "abcdefghijklmno/"] }))),
        // How strings are quoted in messages (Go's %q, not JSON).
        (POOLS, pool(json!({ "addresses": [], "interfaces": ["a/\"\\é\u{a0}\u{2028}\u{85}", "b/\u{1}\u{7f}\u{7}\u{8}\u{c}"] }))),
        (POOLS, pool(json!({ "addresses": [], "interfaces": (0..17).map(|i| format!("eth{i}")).collect::<Vec<_>>() }))),
        (POOLS, json!({ "apiVersion": "vip.dev/v1alpha1", "kind": "VipPool", "metadata": { "name": "worded" } })),
    ];
    let mut answers = Vec::new();
    for (path, body) in cases {
        let o = send(c, Method::POST, path, body.clone()).await;
        assert!(o.code >= 400, "the server took {body}: {}", o.body);
        let mut causes: Vec<String> = o.body["details"]["causes"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|c| format!("{} {}: {}", c["reason"].as_str().unwrap_or(""), c["field"].as_str().unwrap_or("(none)"), c["message"].as_str().unwrap_or("")))
            .collect();
        causes.sort();
        let message = if causes.len() > 1 { String::new() } else { o.message.clone() };
        answers.push(json!({ "request": { "path": path, "body": body }, "code": o.code, "reason": o.reason, "message": message, "causes": causes }));
    }
    // Warnings for pruned fields, and what is stored.
    let pruned = pool(json!({ "addresses": [], "x": 1, "healthCheck": { "type": "http", "y": null, "path": null }, "gratuitousArp": { "z": {} } }));
    let o = send(c, Method::POST, POOLS, pruned.clone()).await;
    let mut warnings = o.warnings.clone();
    warnings.sort();
    answers.push(json!({ "request": { "path": POOLS, "body": pruned }, "code": o.code, "warnings": warnings, "stored": o.ok()["spec"] }));
    Value::Array(answers)
}
