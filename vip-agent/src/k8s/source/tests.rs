use k8s_openapi::{
    api::{
        core::v1::{LoadBalancerIngress, LoadBalancerStatus, NodeAddress, NodeCondition, NodeSpec, NodeStatus, ServicePort, ServiceSpec, ServiceStatus, Taint},
        discovery::v1::{Endpoint, EndpointConditions},
    },
    apimachinery::pkg::apis::meta::v1::ObjectMeta,
};

use super::*;

fn knode(name: &str, ip: &str, ready: bool, labels: &[(&str, &str)], taint: Option<&str>) -> KNode {
    KNode {
        metadata: ObjectMeta {
            name: Some(name.into()),
            labels: Some(labels.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()),
            ..Default::default()
        },
        spec: Some(NodeSpec { taints: taint.map(|k| vec![Taint { key: k.into(), effect: "NoSchedule".into(), ..Default::default() }]), ..Default::default() }),
        status: Some(NodeStatus {
            addresses: Some(vec![NodeAddress { type_: "InternalIP".into(), address: ip.into() }]),
            conditions: Some(vec![NodeCondition { type_: "Ready".into(), status: if ready { "True" } else { "False" }.into(), ..Default::default() }]),
            ..Default::default()
        }),
    }
}

fn kpool(name: &str, yaml: &str) -> VipPool {
    VipPool::new(name, serde_yaml_ng::from_str(yaml).unwrap())
}

fn ksvc(name: &str, ip: Option<&str>, local: bool, ports: &[(&str, i32)]) -> KService {
    KService {
        metadata: ObjectMeta { name: Some(name.into()), namespace: Some("shop".into()), ..Default::default() },
        spec: Some(ServiceSpec {
            type_: Some("LoadBalancer".into()),
            external_traffic_policy: Some(if local { "Local" } else { "Cluster" }.into()),
            health_check_node_port: local.then_some(32000),
            ports: Some(ports.iter().map(|(p, n)| ServicePort { port: *n, protocol: Some(p.to_string()), ..Default::default() }).collect()),
            ..Default::default()
        }),
        status: ip.map(|ip| ServiceStatus {
            load_balancer: Some(LoadBalancerStatus { ingress: Some(vec![LoadBalancerIngress { ip: Some(ip.into()), ..Default::default() }]) }),
            ..Default::default()
        }),
    }
}

fn slice(svc: &str, eps: &[(&str, bool)]) -> EndpointSlice {
    EndpointSlice {
        metadata: ObjectMeta {
            name: Some(format!("{svc}-x")),
            namespace: Some("shop".into()),
            labels: Some([(SERVICE_NAME_LABEL.to_owned(), svc.to_owned())].into()),
            ..Default::default()
        },
        address_type: "IPv4".into(),
        endpoints: eps
            .iter()
            .map(|(n, r)| Endpoint {
                addresses: vec!["10.0.0.1".into()],
                node_name: Some(n.to_string()),
                conditions: Some(EndpointConditions { ready: Some(*r), ..Default::default() }),
                ..Default::default()
            })
            .collect(),
        ports: None,
    }
}

#[tokio::test]
async fn the_start_names_the_watches_that_never_listed() {
    // Lists that arrive after `ms` (None: never), against a timeout far longer than those.
    let after = |name: &'static str, ms: Option<u64>| -> FirstList {
        (
            name,
            Box::pin(async move {
                match ms {
                    Some(ms) => tokio::time::sleep(Duration::from_millis(ms)).await,
                    None => std::future::pending().await,
                }
            }),
        )
    };
    let waits = vec![after("nodes", Some(0)), after("vippools", None), after("services", Some(30)), after("endpointslices", None)];
    assert_eq!(first_lists(waits, Duration::from_secs(1), Duration::from_millis(300)).await, Err(vec!["vippools", "endpointslices"]));
    let waits = vec![after("nodes", Some(10)), after("vippools", Some(50))];
    assert_eq!(first_lists(waits, Duration::from_secs(30), Duration::from_secs(10)).await, Ok(()));

    let line = progress_line(&["nodes"], &["vippools", "services"], Duration::from_secs(5), Duration::from_secs(60));
    assert_eq!(line, "waiting for the first list of vippools, services from the Kubernetes API (done: nodes); 5 s of 60 s (--sync-timeout)");
    let m = sync_timeout_message(&[("vippools", Some("the server could not find the requested resource".into())), ("services", None)], Duration::from_secs(60));
    assert!(m.starts_with("the Kubernetes start gave up after 60 s (--sync-timeout / VIP_SYNC_TIMEOUT): no first list of vippools (last error: the server could not find the requested resource); services (no error seen"), "{m}");
    assert!(m.contains("VipPool CRD may not be installed") && m.contains("deploy/10-rbac.yaml"), "{m}");
    assert!(!sync_timeout_message(&[("services", None)], Duration::from_secs(60)).contains("CRD"), "the CRD hint only when VipPools are missing");
}

#[test]
fn cluster_objects_become_the_model() {
    let nodes = [
        knode("n1", "198.18.0.11", true, &[("vip", "yes")], None),
        knode("n2", "198.18.0.12", true, &[("vip", "yes")], Some("dedicated")),
        knode("n3", "198.18.0.13", false, &[("vip", "yes")], None),
        knode("n4", "198.18.0.14", true, &[], None),
    ];
    let pools = [kpool("p", "addresses: [198.18.1.10-198.18.1.20]\nnodeSelector: {vip: \"yes\"}\ntableSize: 251\nhealthCheck: {type: tcp}\n")];
    let svcs = [
        ksvc("web", Some("198.18.1.10"), false, &[("TCP", 80), ("TCP", 443), ("UDP", 443)]),
        ksvc("local", Some("198.18.1.11"), true, &[("TCP", 8080)]),
        ksvc("pending", None, false, &[("TCP", 80)]),
        ksvc("outside", Some("203.0.113.1"), false, &[("TCP", 80)]),
    ];
    let slices = [slice("local", &[("n1", true), ("n2", false), ("n4", true)])];
    let w = world_from(&nodes, &pools, &svcs, &slices, &World::default());
    assert_eq!(w.nodes.iter().map(|n| n.name.as_str()).collect::<Vec<_>>(), ["n1", "n2", "n4"], "not-ready n3 left out");
    assert_eq!(w.eligible(&w.pools[0]).iter().map(|n| n.name.as_str()).collect::<Vec<_>>(), ["n1"], "n2 tainted, n4 unlabelled");
    let names: Vec<(&str, Protocol, Vec<u16>)> = w.services.iter().map(|s| (s.name.as_str(), s.protocol, s.ports.clone())).collect();
    assert_eq!(names, [("shop/web", Protocol::Tcp, vec![80, 443]), ("shop/web/udp", Protocol::Udp, vec![443]), ("shop/local", Protocol::Tcp, vec![8080])]);
    let web = &w.services[0];
    assert_eq!((web.table_size, web.health.as_ref().unwrap().probe.clone()), (251, Probe::Tcp { port: 80 }));
    let local = &w.services[2];
    assert_eq!(local.backend_nodes, Some(["n1".to_owned(), "n4".to_owned()].into()), "ready endpoints only");
    assert_eq!(w.backend_candidates(local).iter().map(|n| n.name.as_str()).collect::<Vec<_>>(), ["n1"], "and only eligible nodes");
    assert_eq!(local.health.as_ref().unwrap().probe, Probe::Http { port: 32000, path: "/healthz".into() });
    // Only the pool's addresses in use are held (answered by ARP), not the 11 of its range.
    let used: Vec<IpAddr> = w.services.iter().map(|s| s.vip).collect::<std::collections::BTreeSet<_>>().into_iter().collect();
    assert_eq!(w.pools[0].addresses, used);
    assert!(used.len() < 11);
}

#[test]
fn tolerated_taints_keep_nodes_eligible() {
    let nodes = [knode("n2", "198.18.0.12", true, &[], Some("dedicated"))];
    let pools = [kpool("p", "addresses: [198.18.1.10]\ntolerations: [{key: dedicated, operator: Exists}]\n")];
    let w = world_from(&nodes, &pools, &[], &[], &World::default());
    assert_eq!(w.eligible(&w.pools[0]).len(), 1);
}

/// A Node as the API server returns it for a kubeadm cluster: kubelet labels,
/// `Ready` and the other conditions, addresses, and `extra` merged into it.
fn api_node(name: &str, ip: &str, extra: serde_json::Value) -> KNode {
    let mut v = serde_json::json!({
        "apiVersion": "v1", "kind": "Node",
        "metadata": { "name": name, "labels": {
            "kubernetes.io/hostname": name, "kubernetes.io/os": "linux", "kubernetes.io/arch": "amd64",
            "beta.kubernetes.io/os": "linux", "beta.kubernetes.io/arch": "amd64" } },
        "spec": { "podCIDR": "10.244.1.0/24", "podCIDRs": ["10.244.1.0/24"] },
        "status": {
            "addresses": [{ "type": "InternalIP", "address": ip }, { "type": "Hostname", "address": name }],
            "conditions": [
                { "type": "NetworkUnavailable", "status": "False", "reason": "CalicoIsUp", "message": "Calico is running on this node" },
                { "type": "MemoryPressure", "status": "False", "reason": "KubeletHasSufficientMemory" },
                { "type": "DiskPressure", "status": "False", "reason": "KubeletHasNoDiskPressure" },
                { "type": "PIDPressure", "status": "False", "reason": "KubeletHasSufficientPID" },
                { "type": "Ready", "status": "True", "reason": "KubeletReady", "message": "kubelet is posting ready status" }
            ]
        }
    });
    merge(&mut v, extra);
    serde_json::from_value(v).unwrap()
}

/// JSON merge patch (RFC 7386), as `kubectl patch --type merge` applies it.
fn merge(a: &mut serde_json::Value, b: serde_json::Value) {
    match (a, b) {
        (serde_json::Value::Object(a), serde_json::Value::Object(b)) => {
            for (k, v) in b {
                merge(a.entry(k).or_insert(serde_json::Value::Null), v);
            }
        }
        (a, b) => *a = b,
    }
}

fn names<'a>(nodes: impl IntoIterator<Item = &'a model::Node>) -> Vec<&'a str> {
    nodes.into_iter().map(|n| n.name.as_str()).collect()
}

#[test]
fn node_readiness_cordon_and_exclusion_follow_the_cluster() {
    use serde_json::json;
    let conditions_with = |t: &str, status: &str| {
        let mut c = api_node("x", "198.18.0.1", json!({}))
            .status
            .unwrap()
            .conditions
            .unwrap()
            .into_iter()
            .map(|c| json!({ "type": c.type_, "status": c.status }))
            .collect::<Vec<_>>();
        c.iter_mut().filter(|c| c["type"] == t).for_each(|c| c["status"] = status.into());
        json!({ "status": { "conditions": c } })
    };
    let nodes = [
        api_node("plain", "198.18.0.11", json!({})),
        // Ready, but the node controller has not lifted the taint admission put on the new Node.
        api_node("new", "198.18.0.12", json!({ "spec": { "taints": [{ "key": "node.kubernetes.io/not-ready", "effect": "NoSchedule" }] } })),
        // The CNI has not set up the node's routes yet.
        api_node("no-network", "198.18.0.13", conditions_with("NetworkUnavailable", "True")),
        api_node("down", "198.18.0.14", conditions_with("Ready", "Unknown")),
        // `kubectl cordon`: the flag, and the taint the node controller adds for it.
        api_node(
            "cordoned",
            "198.18.0.15",
            json!({ "spec": { "unschedulable": true, "taints": [{ "key": "node.kubernetes.io/unschedulable", "effect": "NoSchedule", "timeAdded": "2025-01-01T00:00:00Z" }] } }),
        ),
        // kubeadm's control-plane node: excluded from load balancers and tainted.
        api_node(
            "cp",
            "198.18.0.16",
            json!({
                "metadata": { "labels": { "node-role.kubernetes.io/control-plane": "", "node.kubernetes.io/exclude-from-external-load-balancers": "" } },
                "spec": { "taints": [{ "key": "node-role.kubernetes.io/control-plane", "effect": "NoSchedule" }] }
            }),
        ),
        // Excluded without any taint: still neither holder nor backend.
        api_node("excluded", "198.18.0.17", json!({ "metadata": { "labels": { "node.kubernetes.io/exclude-from-external-load-balancers": "true" } } })),
        // A pool toleration does not make a not-ready node ready.
        api_node("unreachable", "198.18.0.18", json!({ "spec": { "taints": [{ "key": "node.kubernetes.io/unreachable", "effect": "NoExecute" }] } })),
    ];
    let pools = [
        kpool("p", "addresses: [198.18.1.10-198.18.1.20]\nnodeSelector: {kubernetes.io/os: linux}\n"),
        kpool("all", "addresses: [198.18.2.10]\ntolerations: [{operator: Exists}]\n"),
    ];
    let svcs = [ksvc("web", Some("198.18.1.10"), false, &[("TCP", 80)])];
    let w = world_from(&nodes, &pools, &svcs, &[], &World::default());
    assert_eq!(names(&w.nodes), ["cordoned", "plain"], "not ready, no network, not-ready taints and the exclusion label leave nodes out");
    let why: Vec<(&str, &str)> = w.left_out.iter().map(|(n, r)| (n.as_str(), r.as_str())).collect();
    assert_eq!(
        why,
        [
            ("cp", "labelled node.kubernetes.io/exclude-from-external-load-balancers"),
            ("down", "not Ready"),
            ("excluded", "labelled node.kubernetes.io/exclude-from-external-load-balancers"),
            ("new", "tainted node.kubernetes.io/not-ready"),
            ("no-network", "NetworkUnavailable"),
            ("unreachable", "tainted node.kubernetes.io/unreachable"),
        ],
        "each left-out node with why"
    );
    assert_eq!(names(w.eligible(&w.pools[0])), ["cordoned", "plain"], "a cordoned node keeps holding VIPs");
    assert_eq!(names(w.eligible(&w.pools[1])), ["cordoned", "plain"], "tolerating everything does not bring back not-ready or excluded nodes");
    assert_eq!(names(w.backend_candidates(&w.services[0])), ["cordoned", "plain"], "a cordoned node stays a backend");
    let pool = &w.pools[0];
    let cordoned = w.node("cordoned").unwrap();
    assert!(cordoned.taints.iter().any(|t| t.key == UNSCHEDULABLE_TAINT), "the taint stays in the model, tolerated by the pool");
    assert!(pool.admits(cordoned));
}

/// The first InternalIP, of either family: an IPv6-only node, a dual-stack node
/// of either primary family (kubelet lists it first); no InternalIP leaves it out.
#[test]
fn a_nodes_address_is_its_first_internal_ip() {
    use serde_json::json;
    let with = |addresses: serde_json::Value| json!({ "status": { "addresses": addresses } });
    let internal = |ip: &str| json!({ "type": "InternalIP", "address": ip });
    let nodes = [
        api_node("v4", "198.18.0.11", json!({})),
        api_node("v6", "2001:2::11", json!({})),
        api_node("v4-first", "x", with(json!([internal("198.18.0.13"), internal("2001:2::13")]))),
        api_node("v6-first", "x", with(json!([{ "type": "Hostname", "address": "v6-first" }, internal("2001:2::14"), internal("198.18.0.14")]))),
        api_node("none", "x", with(json!([{ "type": "ExternalIP", "address": "198.18.0.15" }]))),
    ];
    let w = world_from(&nodes, &[], &[], &[], &World::default());
    let addrs: Vec<(&str, String)> = w.nodes.iter().map(|n| (n.name.as_str(), n.addr.to_string())).collect();
    assert_eq!(addrs, [("v4", "198.18.0.11".into()), ("v4-first", "198.18.0.13".into()), ("v6", "2001:2::11".into()), ("v6-first", "2001:2::14".into())]);
    assert_eq!(w.left_out.get("none").map(String::as_str), Some("no InternalIP"));
}

#[test]
fn health_checks_default_to_kube_proxy_on_the_node() {
    let probe = |check: &str, local: bool| {
        let nodes = [knode("n1", "198.18.0.11", true, &[], None)];
        let pools = [kpool("p", &format!("addresses: [198.18.1.10]\nhealthCheck: {check}\n"))];
        let svcs = [ksvc("web", Some("198.18.1.10"), local, &[("TCP", 443), ("TCP", 80)])];
        let w = world_from(&nodes, &pools, &svcs, &[], &World::default());
        w.services[0].health.clone().unwrap().probe
    };
    let http = |port: u16, path: &str| Probe::Http { port, path: path.into() };
    // externalTrafficPolicy: Cluster: kube-proxy's own health server, not NodeIP:443 where nothing listens.
    assert_eq!(probe("{type: http}", false), http(KUBE_PROXY_HEALTHZ_PORT, "/healthz"));
    assert_eq!(probe("{type: http, interval: 1s, timeout: 500ms, rise: 2, fall: 3}", false), http(10256, "/healthz"));
    // Local: the Service's healthCheckNodePort, whatever the pool says.
    assert_eq!(probe("{type: http}", true), http(32000, "/healthz"));
    assert_eq!(probe("{type: tcp, port: 9000}", true), http(32000, "/healthz"));
    // Named explicitly: as written; without a port, `type: tcp` or a path keep probing the Service's first port.
    assert_eq!(probe("{type: http, port: 10256, path: /livez}", false), http(10256, "/livez"));
    assert_eq!(probe("{type: http, path: /ready}", false), http(443, "/ready"));
    assert_eq!(probe("{type: http, port: 8080, path: /ready}", false), http(8080, "/ready"));
    assert_eq!(probe("{type: tcp, port: 9000}", false), Probe::Tcp { port: 9000 });
    assert_eq!(probe("{type: tcp}", false), Probe::Tcp { port: 443 });
}
