//! Switching from MetalLB: Services that MetalLB gave addresses keep them when
//! vip's controller takes over (also after a restart), and MetalLB's annotations
//! are honoured with a Warning suggesting vip's own (against the stand-in and a
//! real kube-apiserver, `both_api_servers!`). `vip-agent import metallb` (the
//! binary) writes VipPools the real server's CRD schema accepts as they are, reads
//! the same from files, stdin and the cluster, and the pools it writes keep the
//! address MetalLB gave a Service and admit the namespaces and Services MetalLB
//! did (the real server only: it labels namespaces with their name). On a
//! dual-stack cluster (both servers), MetalLB's sample pool of both families,
//! imported by the binary, keeps both addresses of every dual-stack Service MetalLB
//! addressed, its IPv6 CIDR's first address included.
use std::{collections::BTreeMap, path::Path, time::Duration};

use k8s_openapi::api::core::v1::Service;
use kube::api::{Api, Patch, PatchParams, PostParams};
use serde_json::{json, Value};
use vip_agent::k8s::{
    controller::{AgentView, Controller, Pass},
    crd::VipPool,
};
use vip_tests::{
    kubeapi::Backend,
    kubefix::{events, eventually, ingress_ips, vip_pool},
};

vip_tests::both_api_servers!(addresses_metallb_gave_are_kept_and_its_annotations_honoured);
vip_tests::both_api_servers!(dual_stack_services_keep_both_addresses_metallb_gave, Stack::Dual);

fn lb(name: &str, port: i32, annotations: Value) -> Service {
    lb_in("shop", name, port, json!({}), annotations)
}

fn lb_in(namespace: &str, name: &str, port: i32, labels: Value, annotations: Value) -> Service {
    serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Service",
        "metadata": { "name": name, "namespace": namespace, "labels": labels, "annotations": annotations },
        "spec": { "type": "LoadBalancer", "ports": [{ "port": port, "protocol": "TCP" }] }
    }))
    .unwrap()
}

/// Passes of `c` until `done` holds for the server's Service addresses (at most
/// 100, 50 ms apart); the sum of what they did.
async fn passes_until(c: &mut Controller, api: &Backend, what: &str, done: impl Fn(&BTreeMap<String, String>) -> bool) -> Pass {
    let mut sum = Pass::default();
    for _ in 0..100 {
        let p = c.pass().await;
        sum.allocated += p.allocated;
        sum.released += p.released;
        sum.pending += p.pending;
        sum.metallb_warnings += p.metallb_warnings;
        if done(&ingress_ips(api)) {
            return sum;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("not reached: {what}; addresses {:?}", ingress_ips(api));
}

/// A restarted agent (or a new leader) starts from the API alone: three passes of
/// a new controller allocate and release nothing, and the addresses (`now`) stay
/// `want`.
async fn restarted_controller_moves_nothing<T: PartialEq + std::fmt::Debug>(client: kube::Client, api: &Backend, want: &T, now: fn(&Backend) -> T) {
    let (mut c, _changed) = Controller::new(client, "node-2", AgentView::fixed(BTreeMap::new()).1);
    c.wait_ready().await;
    for _ in 0..3 {
        let p = c.pass().await;
        assert_eq!((p.allocated, p.released), (0, 0), "{p:?}");
    }
    assert_eq!(&now(api), want, "nothing moved after the restart");
    assert!(events(api, "Released").is_empty(), "{:?}", events(api, "Released"));
}

async fn addresses_metallb_gave_are_kept_and_its_annotations_honoured(api: Backend) {
    let client = api.client().await;
    let pools: Api<VipPool> = Api::all(client.clone());
    let pp = PostParams::default();
    pools.create(&pp, &vip_pool("default", json!({"addresses": ["198.18.5.10-198.18.5.13"]}))).await.unwrap();
    pools.create(&pp, &vip_pool("manual", json!({"addresses": ["198.18.5.20/31"], "autoAssign": false}))).await.unwrap();
    let svcs: Api<Service> = Api::namespaced(client.clone(), "shop");
    // What MetalLB left: addresses in the Services' statuses (not the lowest free
    // ones), one asked for by annotation, one from a pool without autoAssign named
    // by the older annotation form, two sharing one address.
    let held = [
        ("high", 80, json!({}), "198.18.5.13"),
        ("asked", 80, json!({"metallb.io/loadBalancerIPs": "198.18.5.12"}), "198.18.5.12"),
        ("pinned", 80, json!({"metallb.universe.tf/address-pool": "manual"}), "198.18.5.21"),
        ("web", 80, json!({"metallb.io/allow-shared-ip": "front"}), "198.18.5.10"),
        ("tls", 443, json!({"metallb.io/allow-shared-ip": "front"}), "198.18.5.10"),
    ];
    for (name, port, ann, ip) in &held {
        svcs.create(&pp, &lb(name, *port, ann.clone())).await.unwrap();
        let status = json!({"status": {"loadBalancer": {"ingress": [{"ip": ip}]}}});
        svcs.patch_status(name, &PatchParams::default(), &Patch::Merge(&status)).await.unwrap();
    }
    svcs.create(&pp, &lb("new", 80, json!({}))).await.unwrap();
    // An IPv6 address for a Service of the cluster's one family, IPv4, is refused.
    svcs.create(&pp, &lb("v6-only", 80, json!({"metallb.io/loadBalancerIPs": "2001:2::7"}))).await.unwrap();
    // vip's own annotation wins over MetalLB's.
    svcs.create(&pp, &lb("both", 8080, json!({"metallb.io/loadBalancerIPs": "198.18.5.11", "vip.dev/address": "198.18.5.20"}))).await.unwrap();
    let mut want: BTreeMap<String, String> = held.iter().map(|(n, _, _, ip)| (format!("shop/{n}"), ip.to_string())).collect();
    want.insert("shop/new".into(), "198.18.5.11".into());
    want.insert("shop/both".into(), "198.18.5.20".into());

    let (mut c, _changed) = Controller::new(client.clone(), "node-1", AgentView::fixed(BTreeMap::new()).1);
    c.wait_ready().await;
    let p = passes_until(&mut c, &api, "new and both allocated", |now| now.len() == want.len()).await;
    assert_eq!(ingress_ips(&api), want, "no Service that held an address moved");
    assert_eq!((p.allocated, p.released), (2, 0), "{p:?}");
    assert_eq!(p.metallb_warnings, 6, "asked, pinned, web, tls, v6-only, both: {p:?}");
    let warned = |svc: &str| events(&api, "MetalLBAnnotation").into_iter().filter(|e| e.starts_with(&format!("{svc}: "))).collect::<Vec<_>>();
    eventually("6 MetalLBAnnotation events", || events(&api, "MetalLBAnnotation").len() >= 6).await;
    assert_eq!(warned("asked"), ["asked: MetalLB annotations: metallb.io/loadBalancerIPs is honoured: use vip.dev/address instead"]);
    assert_eq!(warned("pinned"), ["pinned: MetalLB annotations: metallb.universe.tf/address-pool is honoured: use vip.dev/pool instead"]);
    assert_eq!(warned("both"), ["both: MetalLB annotations: metallb.io/loadBalancerIPs is ignored: vip.dev/address is set too and wins"]);
    assert!(warned("high").is_empty());
    let failed = events(&api, "AllocationFailed");
    assert!(failed.iter().any(|e| e == "v6-only: requested address 2001:2::7 is IPv6, not of the Service's families (spec.ipFamilies: IPv4)"), "{failed:?}");
    assert_eq!(events(&api, "Allocated").len(), 2, "only new and both were written: {:?}", events(&api, "Allocated"));
    assert!(events(&api, "Released").is_empty(), "{:?}", events(&api, "Released"));

    // Further passes say nothing again.
    for _ in 0..3 {
        let p = c.pass().await;
        assert_eq!((p.allocated, p.released, p.metallb_warnings), (0, 0, 0), "{p:?}");
    }
    // A spec change is no reason to say it again; a changed annotation is.
    svcs.patch("asked", &PatchParams::default(), &Patch::Merge(json!({"spec": {"ports": [{"port": 81, "protocol": "TCP"}]}}))).await.unwrap();
    let own = json!({"metadata": {"annotations": {"vip.dev/address": "198.18.5.12"}}});
    svcs.patch("asked", &PatchParams::default(), &Patch::Merge(own)).await.unwrap();
    let mut again = 0;
    for _ in 0..100 {
        again += c.pass().await.metallb_warnings;
        if again > 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(again, 1, "one Warning for the changed annotation of asked");
    eventually("the second Warning on asked", || warned("asked").len() == 2).await;
    assert!(warned("asked").iter().any(|e| e.ends_with("metallb.io/loadBalancerIPs is ignored: vip.dev/address is set too and wins")), "{:?}", warned("asked"));
    assert_eq!(c.pass().await.metallb_warnings, 0);

    drop(c);
    restarted_controller_moves_nothing(client, &api, &want, ingress_ips).await;
}

/// MetalLB's sample IPAddressPool (its documentation's first), in test addresses:
/// an IPv4 CIDR, an IPv4 range and an IPv6 CIDR in one pool, announced over L2.
const METALLB_SAMPLE: &str = r#"apiVersion: metallb.io/v1beta1
kind: IPAddressPool
metadata:
  name: first-pool
  namespace: metallb-system
spec:
  addresses:
  - 198.18.10.0/24
  - 198.18.9.1-198.18.9.5
  - 2001:2:0:e799::/124
---
apiVersion: metallb.io/v1beta1
kind: L2Advertisement
metadata:
  name: example
  namespace: metallb-system
"#;

/// Every Service's `status.loadBalancer.ingress` addresses, in order.
fn ingress_all(api: &Backend) -> BTreeMap<String, Vec<String>> {
    api.list("services", None)
        .into_iter()
        .map(|s| {
            let ips = s["status"]["loadBalancer"]["ingress"].as_array().into_iter().flatten().filter_map(|i| Some(i["ip"].as_str()?.to_owned())).collect();
            (format!("{}/{}", s["metadata"]["namespace"].as_str().unwrap(), s["metadata"]["name"].as_str().unwrap()), ips)
        })
        .collect()
}

/// MetalLB's sample pool imported by the binary and applied; dual-stack Services
/// as MetalLB left them (its allocation order: the first address of each CIDR
/// first, so the first Service holds the IPv6 CIDR's first address; the status
/// IPv4 first whatever `ipFamilies` says; its `ip-allocated-from-pool` note; its
/// annotations in both forms): the running controller keeps both addresses of
/// every one, also after a restart, and gives a new dual-stack Service a pair.
async fn dual_stack_services_keep_both_addresses_metallb_gave(api: Backend) {
    let (code, out, warnings) = import(&["-f", "-"], METALLB_SAMPLE).await;
    assert_eq!(code, Some(0), "{warnings}");
    assert!(warnings.ends_with("# 1 VipPool(s) from 2 MetalLB object(s), 1 warning(s)\n"), "{warnings}");
    assert!(warnings.contains("first-pool: spec.addresses[2]: \"2001:2:0:e799::/124\" written as the range 2001:2:0:e799::-2001:2:0:e799::f"), "{warnings}");
    let imported: Vec<VipPool> = vip_tests::kubeapi::documents(&out).unwrap().into_iter().map(|d| serde_json::from_value(d).unwrap()).collect();
    assert_eq!(imported.len(), 1, "{out}");
    assert_eq!(imported[0].spec.addresses, ["198.18.10.0/24", "198.18.9.1-198.18.9.5", "2001:2:0:e799::-2001:2:0:e799::f"]);

    let client = api.client().await;
    let pp = PostParams::default();
    let pools: Api<VipPool> = Api::all(client.clone());
    for p in &imported {
        pools.create(&pp, p).await.unwrap();
    }
    let svcs: Api<Service> = Api::namespaced(client.clone(), "shop");
    let require = json!({"ipFamilyPolicy": "RequireDualStack"});
    let prefer = json!({"ipFamilyPolicy": "PreferDualStack"});
    let v6_first = json!({"ipFamilyPolicy": "RequireDualStack", "ipFamilies": ["IPv6", "IPv4"]});
    let from_pool = |extra: Value| {
        let mut a = json!({"metallb.io/ip-allocated-from-pool": "first-pool"});
        a.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
        a
    };
    let held: [(&str, i32, &Value, Value, [&str; 2]); 6] = [
        ("first", 80, &prefer, from_pool(json!({})), ["198.18.10.0", "2001:2:0:e799::"]),
        ("v6-first", 80, &v6_first, from_pool(json!({})), ["198.18.10.1", "2001:2:0:e799::1"]),
        ("asked", 80, &require, from_pool(json!({"metallb.io/loadBalancerIPs": "198.18.9.3,2001:2:0:e799::9"})), ["198.18.9.3", "2001:2:0:e799::9"]),
        ("pinned", 80, &prefer, from_pool(json!({"metallb.universe.tf/address-pool": "first-pool"})), ["198.18.10.2", "2001:2:0:e799::2"]),
        ("web", 80, &require, from_pool(json!({"metallb.io/allow-shared-ip": "front"})), ["198.18.10.3", "2001:2:0:e799::3"]),
        ("tls", 443, &require, from_pool(json!({"metallb.io/allow-shared-ip": "front"})), ["198.18.10.3", "2001:2:0:e799::3"]),
    ];
    let dual_lb = |name: &str, port: i32, families: &Value, annotations: Value| {
        let mut s = lb(name, port, annotations);
        let spec = serde_json::to_value(s.spec.take().unwrap()).unwrap();
        let mut spec = spec.as_object().unwrap().clone();
        spec.extend(families.as_object().unwrap().clone());
        s.spec = Some(serde_json::from_value(Value::Object(spec)).unwrap());
        s
    };
    for (name, port, families, ann, ips) in &held {
        svcs.create(&pp, &dual_lb(name, *port, families, ann.clone())).await.unwrap();
        let status = json!({"status": {"loadBalancer": {"ingress": [{"ip": ips[0]}, {"ip": ips[1]}]}}});
        svcs.patch_status(name, &PatchParams::default(), &Patch::Merge(&status)).await.unwrap();
    }
    svcs.create(&pp, &dual_lb("new", 80, &require, json!({}))).await.unwrap();
    let mut want: BTreeMap<String, Vec<String>> = held.iter().map(|(n, .., ips)| (format!("shop/{n}"), ips.map(str::to_owned).to_vec())).collect();
    // The lowest free address of each family: the pool's range before its /24.
    want.insert("shop/new".into(), vec!["198.18.9.1".into(), "2001:2:0:e799::4".into()]);

    let (mut c, _changed) = Controller::new(client.clone(), "node-1", AgentView::fixed(BTreeMap::new()).1);
    c.wait_ready().await;
    let p = passes_until(&mut c, &api, "new gets a pair", |_| ingress_all(&api).get("shop/new").is_some_and(|ips| ips.len() == 2)).await;
    assert_eq!(ingress_all(&api), want, "no Service that held an address moved, either family");
    assert_eq!((p.allocated, p.released), (2, 0), "new's two addresses only: {p:?}");
    assert_eq!(p.metallb_warnings, 4, "asked, pinned, web, tls: {p:?}");
    eventually("4 MetalLBAnnotation events", || events(&api, "MetalLBAnnotation").len() >= 4).await;
    assert!(events(&api, "Released").is_empty(), "{:?}", events(&api, "Released"));
    assert!(events(&api, "AllocationFailed").is_empty(), "{:?}", events(&api, "AllocationFailed"));

    drop(c);
    restarted_controller_moves_nothing(client, &api, &want, ingress_all).await;
}

/// MetalLB's configuration as a user may have it (written for this test): a pool
/// that hands out its /24's network address (no avoidBuggyIPs) and has an IPv6
/// block, a tenant pool for two namespaces and two apps whose range crosses a .255,
/// a pool without autoAssign; advertisements by name and by pool label, and BGP.
const METALLB: &str = r#"apiVersion: metallb.io/v1beta1
kind: IPAddressPool
metadata: {name: general, namespace: metallb-system}
spec:
  addresses: [198.18.50.0/24, "2001:2:0:50::/120"]
---
apiVersion: metallb.io/v1beta1
kind: IPAddressPool
metadata: {name: tenant, namespace: metallb-system, labels: {tier: tenant}}
spec:
  addresses: ["198.18.51.254 - 198.18.52.5"]
  avoidBuggyIPs: true
  serviceAllocation:
    priority: 10
    namespaces: [team-a, team-b]
    serviceSelectors:
    - matchExpressions: [{key: app, operator: In, values: [web, api]}]
---
apiVersion: metallb.io/v1beta1
kind: IPAddressPool
metadata: {name: reserved, namespace: metallb-system}
spec: {addresses: [198.18.53.8/29], autoAssign: false}
---
apiVersion: metallb.io/v1beta1
kind: L2Advertisement
metadata: {name: tenant-edge, namespace: metallb-system}
spec:
  ipAddressPoolSelectors: [{matchLabels: {tier: tenant}}]
  nodeSelectors: [{matchLabels: {example.com/edge: "true"}}]
  interfaces: [eth1, ens4]
---
apiVersion: metallb.io/v1beta1
kind: L2Advertisement
metadata: {name: rest, namespace: metallb-system}
spec: {ipAddressPools: [general, reserved]}
---
apiVersion: metallb.io/v1beta1
kind: BGPAdvertisement
metadata: {name: uplink, namespace: metallb-system}
spec: {ipAddressPools: [general], localPref: 50}
"#;

/// A namespaced CRD of `metallb.io` that keeps whatever spec it is given: a
/// stand-in for MetalLB's own (the import reads what the server serves).
fn metallb_crd(kind: &str, plural: &str, version: &str) -> Value {
    json!({
        "apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
        "metadata": {"name": format!("{plural}.metallb.io")},
        "spec": {"group": "metallb.io", "scope": "Namespaced",
            "names": {"kind": kind, "plural": plural, "singular": kind.to_lowercase(), "listKind": format!("{kind}List")},
            "versions": [{"name": version, "served": true, "storage": true, "schema": {"openAPIV3Schema": {"type": "object",
                "properties": {"spec": {"type": "object", "x-kubernetes-preserve-unknown-fields": true}}}}}]}
    })
}

/// `vip-agent import metallb ARGS` with `stdin`: (exit code, stdout, stderr).
async fn import(args: &[&str], stdin: &str) -> (Option<i32>, String, String) {
    use tokio::io::AsyncWriteExt as _;
    let mut child = tokio::process::Command::new(vip_tests::agent::agent_bin().unwrap())
        .args(["import", "metallb"])
        .args(args)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let mut input = child.stdin.take().unwrap();
    input.write_all(stdin.as_bytes()).await.unwrap();
    drop(input);
    let o = tokio::time::timeout(Duration::from_secs(60), child.wait_with_output()).await.expect("import finishes").unwrap();
    (o.status.code(), String::from_utf8_lossy(&o.stdout).into_owned(), String::from_utf8_lossy(&o.stderr).into_owned())
}

fn sorted_lines(s: &str) -> Vec<&str> {
    let mut v: Vec<&str> = s.lines().collect();
    v.sort();
    v
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[cfg_attr(not(real_apiserver), ignore = "needs KUBEBUILDER_ASSETS (kube-apiserver, etcd; docs/development/tests.md)")]
async fn imported_pools_are_accepted_and_keep_what_metallb_gave() {
    use vip_tests::kubeapi::{apply, discover, documents, ensure_namespace};
    let Some(api) = Backend::real().await else { return };
    let Backend::Real { server, .. } = &api else { unreachable!() };
    let client = api.client().await;
    let dir = vip_tests::agent::TempDir::new("vip-import-").unwrap();
    let (input, kubeconfig) = (dir.0.join("metallb.yaml"), dir.0.join("kubeconfig"));
    std::fs::write(&input, METALLB).unwrap();
    server.kubeconfig_admin(&kubeconfig).unwrap();
    let path = |p: &Path| p.to_str().unwrap().to_owned();

    // From a file, and the same from stdin.
    let (code, pools, warnings) = import(&["-f", &path(&input)], "").await;
    assert_eq!(code, Some(0), "{warnings}");
    assert!(warnings.ends_with("# 3 VipPool(s) from 6 MetalLB object(s), 4 warning(s)\n"), "{warnings}");
    for w in [
        "# warning: IPAddressPool metallb-system/general: spec.addresses[1]: \"2001:2:0:50::/120\" written as the range 2001:2:0:50::-2001:2:0:50::ff",
        "# warning: IPAddressPool metallb-system/tenant: spec.serviceAllocation.priority: 10: no equivalent",
        "# warning: BGPAdvertisement metallb-system/uplink: not imported: vip's BGP speaker (announce: bgp) is file mode only so far (set here, with no equivalent: localPref)",
        "# warning: IPAddressPool metallb-system/tenant: interfaces [eth1, ens4]",
    ] {
        assert!(warnings.contains(w), "{w} missing:\n{warnings}");
    }
    assert_eq!(import(&["-f", "-"], METALLB).await, (Some(0), pools.clone(), warnings.clone()));

    // Accepted by the CRD schema as written: no field pruned or refused.
    let docs = documents(&pools).unwrap();
    assert_eq!(docs.len(), 3, "{pools}");
    for d in &docs {
        let said = apply(&client, d, false).await.unwrap_or_else(|e| panic!("{e:#}\n{d}"));
        assert!(said.is_empty(), "server warnings {said:?} for {d}");
        let name = d["metadata"]["name"].as_str().unwrap();
        let stored: VipPool = serde_json::from_value(api.get("vippools.vip.dev", None, name).unwrap()).unwrap();
        let written: VipPool = serde_json::from_value(d.clone()).unwrap();
        assert_eq!(stored.spec, written.spec, "{name} as stored");
    }
    let tenant: VipPool = serde_json::from_value(docs.iter().find(|d| d["metadata"]["name"] == "tenant").unwrap().clone()).unwrap();
    assert_eq!(tenant.spec.excluded_ips, ["198.18.51.255", "198.18.52.0"]);
    assert_eq!(tenant.spec.interfaces, ["eth1", "ens4"]);
    assert_eq!(tenant.spec.node_selector, BTreeMap::from([("example.com/edge".to_owned(), "true".to_owned())]));

    // From the cluster: nothing to read before MetalLB's kinds exist, then the same pools.
    let (code, out, err) = import(&["--from-cluster", "--kubeconfig", &path(&kubeconfig)], "").await;
    assert_eq!((code, out.as_str()), (Some(1), ""), "{err}");
    assert!(err.contains("the cluster serves no metallb.io API group (is MetalLB installed?)"), "{err}");
    let crds = [
        ("IPAddressPool", "ipaddresspools", "v1beta1"),
        ("L2Advertisement", "l2advertisements", "v1beta1"),
        ("BGPAdvertisement", "bgpadvertisements", "v1beta1"),
    ];
    for (kind, plural, version) in crds {
        apply(&client, &metallb_crd(kind, plural, version), false).await.unwrap();
    }
    ensure_namespace(&client, "metallb-system").await.unwrap();
    for (kind, _, version) in crds {
        let mut tries = 0;
        while discover(&client, &format!("metallb.io/{version}"), kind).await.is_err() {
            tries += 1;
            assert!(tries < 300, "{kind} never served");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
    for d in documents(METALLB).unwrap() {
        apply(&client, &d, false).await.unwrap();
    }
    let (code, from_cluster, err) = import(&["--from-cluster", "--kubeconfig", &path(&kubeconfig)], "").await;
    assert_eq!(code, Some(0), "{err}");
    assert_eq!(from_cluster, pools, "the same VipPools from the cluster as from the file");
    assert_eq!(sorted_lines(&err), sorted_lines(&warnings), "the same warnings");
    // Unreadable input: exit 1, nothing on stdout.
    let (code, out, err) = import(&["-f", &path(&dir.0.join("missing.yaml"))], "").await;
    assert_eq!((code, out.as_str()), (Some(1), ""), "{err}");
    assert!(err.contains("missing.yaml"), "{err}");

    // What MetalLB gave stays: the general pool's network address (MetalLB hands
    // it out without avoidBuggyIPs); the tenant pool admits team-a's web and api
    // Services only, as MetalLB did.
    for ns in ["team-a", "team-b"] {
        ensure_namespace(&client, ns).await.unwrap();
    }
    let pp = PostParams::default();
    let shop: Api<Service> = Api::namespaced(client.clone(), "shop");
    shop.create(&pp, &lb("legacy", 80, json!({}))).await.unwrap();
    let status = json!({"status": {"loadBalancer": {"ingress": [{"ip": "198.18.50.0"}]}}});
    shop.patch_status("legacy", &PatchParams::default(), &Patch::Merge(&status)).await.unwrap();
    shop.create(&pp, &lb("fresh", 80, json!({}))).await.unwrap();
    let tenant_pool = json!({"metallb.io/address-pool": "tenant"});
    shop.create(&pp, &lb_in("shop", "web", 80, json!({"app": "web"}), tenant_pool.clone())).await.unwrap();
    let team_a: Api<Service> = Api::namespaced(client.clone(), "team-a");
    team_a.create(&pp, &lb_in("team-a", "web", 80, json!({"app": "web"}), tenant_pool.clone())).await.unwrap();
    team_a.create(&pp, &lb_in("team-a", "db", 5432, json!({"app": "db"}), tenant_pool.clone())).await.unwrap();
    let (mut c, _changed) = Controller::new(client.clone(), "node-1", AgentView::fixed(BTreeMap::new()).1);
    c.wait_ready().await;
    let want: BTreeMap<String, String> = [("shop/legacy", "198.18.50.0"), ("shop/fresh", "198.18.50.1"), ("team-a/web", "198.18.51.254")]
        .into_iter()
        .map(|(k, v)| (k.into(), v.into()))
        .collect();
    let p = passes_until(&mut c, &api, "fresh and team-a/web allocated", |now| now.len() == want.len()).await;
    assert_eq!(ingress_ips(&api), want);
    assert_eq!((p.allocated, p.released), (2, 0), "{p:?}");
    let failed = events(&api, "AllocationFailed");
    for svc in ["web", "db"] {
        let why = format!("{svc}: VipPool \"tenant\" (metallb.io/address-pool) does not admit this Service (its selectors)");
        assert!(failed.contains(&why), "{why} missing: {failed:?}");
    }
    // The binary's other tests share this server: MetalLB's kinds go.
    for (_, plural, _) in crds {
        let crd = format!("/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{plural}.metallb.io");
        vip_tests::kubeapi::raw(&client, http::Method::DELETE, &crd, "", None).await.unwrap().ok().unwrap();
    }
}
