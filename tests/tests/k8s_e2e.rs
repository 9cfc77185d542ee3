//! End to end with Kubernetes as the source: an API server runs in a namespace of
//! the lab (198.18.0.2), three nodes run the real `vip-agent run --kubernetes`
//! with a kubeconfig pointing at it. The same scenario runs against the in-process
//! stand-in and against a real kube-apiserver with etcd (the agents then act as the
//! deploy/10-rbac.yaml ServiceAccount; the test does what a kubelet and the node
//! controller would: Node status, the not-ready taint, EndpointSlices).
//!
//! A VipPool and a LoadBalancer Service are created through the API: the elected
//! agent allocates the Service an address, the pool reports Ready with its counts,
//! the address answers ARP from exactly one node and connections to it spread over
//! all three nodes; the pool's status names that node; then the Service turns
//! `externalTrafficPolicy: Local` and its EndpointSlice changes move every agent's
//! ring to the nodes with endpoints.
//!
//! Bad pools applied beside the working one (a non-prime `tableSize`, an overlap),
//! each asked for by a Service: they say why in their conditions, nothing of them is
//! allocated or answered, and the working VIP keeps its owner and serves.
//!
//! The VIP's VipStatus names its holder, interface and backends (which follow the
//! rings), `kubectl get vipstatuses` shows them in columns (real server); after the
//! holder's agent stops, it names the new holder within seconds; a VIP that leaves
//! its last Service loses its VipStatus.
//!
//! On the real server an API outage follows: kube-apiserver SIGKILLed and kept down
//! 30 s while the client opens a connection to the VIP every 150 ms (none may
//! fail), then restarted on the same etcd: no address changes, and a new Service
//! gets one.
use std::{
    collections::BTreeMap,
    path::Path,
    sync::Mutex,
    time::{Duration, Instant},
};

use serde_json::json;
use vip_tests::{
    agent::{agent_bin, wait_for},
    halab::{ask, spawn_probes, vip, HaSpec},
    kubelab::{endpoint_slice, lb_service, ring_backends, KubeLab, HEALTH_CHECK_NODE_PORT},
    netns::privileged,
};

/// One lab at a time (the two tests would share the machine's two cores).
static SERIAL: Mutex<()> = Mutex::new(());

fn lab_exe() -> &'static Path {
    Path::new(env!("CARGO_BIN_EXE_vip-lab"))
}

#[test]
fn service_gets_a_vip_that_answers_and_spreads_over_the_nodes() {
    if !privileged() {
        return;
    }
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    agent_bin().expect("the vip-agent binary (cargo xtask test builds it)");
    let mut kl = KubeLab::start(spec(), lab_exe()).unwrap();
    scenario(&kl);
    bad_pools_beside_a_good_one(&kl);
    arp_conflict(&kl);
    excluded(&mut kl);
    failover_and_release(&mut kl);
}

#[test]
#[cfg_attr(not(real_apiserver), ignore = "needs KUBEBUILDER_ASSETS (kube-apiserver, etcd; docs/development/tests.md)")]
fn real_api_server_vip_answers_spreads_and_rides_out_an_api_outage() {
    if !privileged() {
        return;
    }
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    agent_bin().expect("the vip-agent binary (cargo xtask test builds it)");
    let Some(mut kl) = KubeLab::start_real(spec(), lab_exe()).unwrap() else {
        return;
    };
    let server = kl.api.real().unwrap();
    eprintln!("real API server: kube-apiserver {} at {} (ready {:.1} s after start)", server.version(), server.url(), server.startup().as_secs_f64());
    scenario(&kl);
    let v = vip(0);
    let holder = vip_status(&kl, v, "a holder", |s| s["holder"].as_str().is_some())["holder"].as_str().unwrap().to_owned();
    let kubectl = kl.kubectl(&["get", "vipstatuses"]);
    let header: Vec<&str> = kubectl.lines().next().unwrap_or_default().split_whitespace().collect();
    assert_eq!(header, ["NAME", "VIP", "HOLDER", "INTERFACE", "VLAN", "SINCE", "LAST", "GARP", "BACKENDS"], "{kubectl}");
    let row = kubectl.lines().find(|l| l.starts_with("198-18-1-10 ")).unwrap_or_else(|| panic!("no row for {v}:\n{kubectl}"));
    let cells: Vec<&str> = row.split_whitespace().collect();
    // No VLAN (untagged): an empty cell.
    assert_eq!((cells[1], cells[2], cells[3], cells[6]), (v.to_string().as_str(), holder.as_str(), "eth0", r#"["node-1"]"#), "{kubectl}");
    eprintln!("kubectl get vipstatuses:\n{kubectl}");
    arp_conflict(&kl);
    excluded(&mut kl);
    failover_and_release(&mut kl);
    outage(&kl);
}

/// The lab, its agents checking who answers ARP for each VIP every second.
/// Bad pools applied beside the working one, on running agents: one whose
/// `tableSize` is no prime (the schema's range admits it), one overlapping the
/// working pool, each asked for by a Service. The working VIP stays held by its
/// owner and answered; nothing of the bad pools is allocated or answered; each
/// says why in its conditions, naming the field; deleted, they leave the working
/// pool as it was.
fn bad_pools_beside_a_good_one(kl: &KubeLab) {
    let (lab, api) = (&kl.lab, &kl.api);
    let all: Vec<usize> = (0..lab.nodes.len()).collect();
    let owners = lab.wait_converged_on(&all, 1, Duration::from_secs(10)).unwrap_or_else(|e| panic!("{e:#}\n{}", lab.agent_logs()));
    let pool = |name: &str, addresses: String, table: u32| {
        json!({
            "apiVersion": "vip.dev/v1alpha1", "kind": "VipPool", "metadata": { "name": name },
            "spec": { "addresses": [addresses], "nodeSelector": { "lab": "yes" }, "tableSize": table }
        })
    };
    api.insert("vippools.vip.dev", pool("bad-table", format!("{}-{}", vip(4), vip(5)), 252)).unwrap();
    api.insert("vippools.vip.dev", pool("overlap", format!("{}-{}", vip(2), vip(3)), 251)).unwrap();
    for (svc, pool) in [("asks-bad-table", "bad-table"), ("asks-overlap", "overlap")] {
        let s = json!({
            "apiVersion": "v1", "kind": "Service", "metadata": { "name": svc, "namespace": "shop", "annotations": { "vip.dev/pool": pool } },
            "spec": { "type": "LoadBalancer", "externalTrafficPolicy": "Cluster", "ports": [{ "port": 80, "protocol": "TCP" }] }
        });
        api.insert("services", s).unwrap();
    }
    for (name, reason, says) in [("bad-table", "InvalidSpec", "spec.tableSize"), ("overlap", "Overlap", "spec.addresses")] {
        let ready = || -> Option<serde_json::Value> {
            let p = api.get("vippools.vip.dev", None, name)?;
            p["status"]["conditions"].as_array()?.iter().find(|c| c["type"] == "Ready").cloned()
        };
        let said = wait_for(Duration::from_secs(10), || {
            ready().filter(|c| c["status"] == "False" && c["reason"] == reason && c["message"].as_str().is_some_and(|m| m.contains(says)))
        });
        assert!(said.is_some(), "VipPool {name}'s Ready: {:?}\n{}", ready(), lab.agent_logs());
    }
    // The working VIP: the same owner, answered by it, connections served.
    assert_eq!(lab.wait_converged_on(&all, 1, Duration::from_secs(10)).unwrap_or_else(|e| panic!("{e:#}\n{}", lab.agent_logs())), owners);
    let v = vip(0);
    assert_eq!(lab.client_neigh(v), Some(lab.nodes[lab.index_of(&owners[&v])].mac));
    for p in 0..10 {
        ask(&lab.client, v, 46500 + p, Duration::from_secs(2)).unwrap_or_else(|e| panic!("the working VIP beside bad pools: {e:#}"));
    }
    // Nothing of the bad ones: no address for their Services, none answered.
    for svc in ["asks-bad-table", "asks-overlap"] {
        let got = api.get("services", Some("shop"), svc).unwrap();
        assert!(got["status"]["loadBalancer"]["ingress"].as_array().is_none_or(|i| i.is_empty()), "{svc} got an address from a bad pool: {got}");
    }
    for a in [vip(3), vip(4), vip(5)] {
        let (answered, out) = vip_tests::netns::arping(&lab.client, "eth0", a);
        assert!(!answered, "{a} of a bad pool answered:\n{out}");
    }
    for svc in ["asks-bad-table", "asks-overlap"] {
        api.delete("services", Some("shop"), svc).unwrap();
    }
    for name in ["bad-table", "overlap"] {
        api.delete("vippools.vip.dev", None, name).unwrap();
    }
    let lab_ready = wait_for(Duration::from_secs(10), || {
        let p = api.get("vippools.vip.dev", None, "lab")?;
        p["status"]["conditions"].as_array()?.iter().any(|c| c["type"] == "Ready" && c["status"] == "True").then_some(())
    });
    assert!(lab_ready.is_some(), "{:?}", api.get("vippools.vip.dev", None, "lab"));
    assert_eq!(lab.wait_converged_on(&all, 1, Duration::from_secs(10)).unwrap(), owners);
}

fn spec() -> HaSpec {
    HaSpec { arp_check_ms: Some(1000), ..HaSpec::default() }
}

/// A second responder for the VIP on the segment (a host with the address on its
/// interface): the holder's VipStatus turns `ArpConflict=True` naming its MAC, one
/// `ArpConflict` Warning on the Service, the holder's `vip_arp_foreign_answers` 1;
/// gone, `ArpConflict=False`, an `ArpConflictResolved` Event, the metric 0.
fn arp_conflict(kl: &KubeLab) {
    let (lab, api) = (&kl.lab, &kl.api);
    let v = vip(0);
    let arp =
        |s: &serde_json::Value, status: &str| s["conditions"].as_array().into_iter().flatten().any(|c| c["type"] == "ArpConflict" && c["status"] == status);
    let events = |reason: &str| {
        api.list("events.events.k8s.io", None).into_iter().filter(|e| e["reason"] == reason && e["regarding"]["name"] == "web").collect::<Vec<_>>()
    };
    let s = vip_status(kl, v, "checked by a peer", |s| arp(s, "False"));
    let holder = lab.index_of(s["holder"].as_str().unwrap());
    let series = format!(r#"vip_arp_foreign_answers{{vip="{v}"}}"#);
    let foreign = |want: f64| wait_for(Duration::from_secs(10), || (vip_tests::halab::metric(&lab.metrics(holder), &series) == Some(want)).then_some(()));

    let rogue = lab.seg.plug(vip_tests::netns::NetNs::new("vrogue").unwrap(), "198.18.0.99/24").unwrap();
    let mac = vip_agent::ha::arpcheck::mac_text(&rogue.mac("eth0").unwrap());
    rogue.ip(&["addr", "add", &format!("{v}/32"), "dev", "eth0"]).unwrap();
    let s = vip_status(kl, v, "ArpConflict=True", |s| arp(s, "True"));
    let c = s["conditions"].as_array().unwrap().iter().find(|c| c["type"] == "ArpConflict").unwrap();
    assert!(c["message"].as_str().unwrap().contains(&mac), "the condition names the rogue's MAC {mac}: {c}");
    assert!(foreign(1.0).is_some(), "{series} not 1 on the holder:\n{}", lab.metrics(holder));
    assert!(wait_for(Duration::from_secs(10), || (events("ArpConflict").len() == 1).then_some(())).is_some(), "no ArpConflict Warning on web");
    assert_eq!(events("ArpConflict")[0]["type"], "Warning");

    rogue.ip(&["addr", "del", &format!("{v}/32"), "dev", "eth0"]).unwrap();
    vip_status(kl, v, "ArpConflict=False again", |s| arp(s, "False"));
    assert!(foreign(0.0).is_some(), "{series} not back to 0 on the holder");
    assert!(wait_for(Duration::from_secs(10), || (events("ArpConflictResolved").len() == 1).then_some(())).is_some(), "no ArpConflictResolved Event on web");
    assert_eq!(events("ArpConflict").len(), 1, "one Warning for the whole episode");
}

/// VIP `v`'s VipStatus's status once `ok` holds for it (within 10 s: the holder
/// writes each VIP at most every 3 s).
fn vip_status(kl: &KubeLab, v: std::net::Ipv4Addr, what: &str, ok: impl Fn(&serde_json::Value) -> bool) -> serde_json::Value {
    let name = vip_agent::k8s::crd::vip_status_name(v.into());
    let got = wait_for(Duration::from_secs(10), || {
        let o = kl.api.get("vipstatuses.vip.dev", None, &name)?;
        (o["spec"]["address"] == v.to_string() && ok(&o["status"])).then(|| o["status"].clone())
    });
    got.unwrap_or_else(|| panic!("VipStatus {name}: not {what} within 10 s: {:?}\n{}", kl.api.get("vipstatuses.vip.dev", None, &name), kl.lab.agent_logs()))
}

/// The holder's agent stops: the status names the new holder within seconds; the
/// agent comes back. Then a Service made and deleted: its VIP's VipStatus comes and goes.
fn failover_and_release(kl: &mut KubeLab) {
    let v = vip(0);
    let old = vip_status(kl, v, "held", |s| s["holder"].is_string())["holder"].as_str().unwrap().to_owned();
    let i = kl.lab.index_of(&old);
    let t0 = Instant::now();
    kl.lab.stop_agent(i, libc::SIGTERM);
    let s = vip_status(kl, v, "held by another node", |s| s["holder"].is_string() && s["holder"] != old.as_str());
    eprintln!("VipStatus: {v} held by {} (was {old}) {:.1} s after its agent stopped", s["holder"], t0.elapsed().as_secs_f64());
    let new = s["holder"].as_str().unwrap();
    let up: Vec<usize> = (0..kl.lab.nodes.len()).filter(|&j| j != i).collect();
    let owners = kl.lab.wait_converged_on(&up, 1, Duration::from_secs(10)).unwrap();
    assert_eq!(owners[&v], new, "the status names the holder the agents agree on");
    assert_eq!(s["conditions"][0]["type"], "Held");
    assert_eq!((s["conditions"][0]["status"].as_str(), s["interface"].as_str()), (Some("True"), Some("eth0")), "{s}");
    kl.lab.start_agent(i).unwrap();

    kl.api.insert("services", lb_service("shop", "brief", false)).unwrap();
    let addr = wait_for(Duration::from_secs(20), || {
        kl.api.get("services", Some("shop"), "brief")?["status"]["loadBalancer"]["ingress"][0]["ip"].as_str().map(str::to_owned)
    });
    let addr: std::net::Ipv4Addr = addr.unwrap_or_else(|| panic!("no address for brief\n{}", kl.lab.agent_logs())).parse().unwrap();
    let s = vip_status(kl, addr, "held", |s| s["holder"].is_string() && s["backends"].as_array().is_some_and(|b| b.len() == 3));
    assert_eq!(s["backends"], json!(["node-1", "node-2", "node-3"]), "a Cluster-policy Service spreads to every node");
    assert!(kl.api.delete("services", Some("shop"), "brief").unwrap());
    let name = vip_agent::k8s::crd::vip_status_name(addr.into());
    let gone = wait_for(Duration::from_secs(10), || kl.api.get("vipstatuses.vip.dev", None, &name).is_none().then_some(()));
    assert!(gone.is_some(), "VipStatus {name} outlived its VIP's last Service\n{}", kl.lab.agent_logs());
}

/// Every node labelled out of load balancers, as a user would (kubectl label on the
/// real server): the VIP goes unanswered, and that is said where users look: the
/// pool's `Held=False` naming the label, a `NotHeld` Event on the Service, the VIP's
/// VipStatus `Held=False`, `vip_pool_vips_unowned` on the agents. The labels go:
/// answered again, `Held=True`, a `Held` Event.
fn excluded(kl: &mut KubeLab) {
    const LABEL: &str = vip_agent::k8s::source::EXCLUDE_FROM_LB_LABEL;
    let v = vip(0);
    let label = |kl: &KubeLab, on: bool| {
        for (i, n) in kl.lab.nodes.iter().enumerate() {
            if kl.api.is_real() {
                kl.kubectl(&["label", "node", &n.name, &if on { format!("{LABEL}=") } else { format!("{LABEL}-") }]);
            } else {
                let mut o = vip_tests::kubelab::node_object(&n.name, &vip_tests::halab::node_addr(i).to_string());
                if on {
                    o["metadata"]["labels"][LABEL] = "".into();
                }
                kl.api.insert("nodes", o).unwrap();
            }
        }
    };
    let pool_held = |kl: &KubeLab, status: &str| {
        let api = &kl.api;
        wait_for(Duration::from_secs(15), || {
            let p = api.get("vippools.vip.dev", None, "lab")?;
            p["status"]["conditions"].as_array()?.iter().find(|c| c["type"] == "Held" && c["status"] == status).cloned()
        })
        .unwrap_or_else(|| panic!("pool lab not Held={status} within 15 s: {:?}\n{}", api.get("vippools.vip.dev", None, "lab"), kl.lab.agent_logs()))
    };
    let events = |kl: &KubeLab, reason: &str| {
        kl.api.list("events.events.k8s.io", None).into_iter().filter(|e| e["reason"] == reason && e["regarding"]["name"] == "web").count()
    };
    let answered = |kl: &KubeLab| vip_tests::netns::arping(&kl.lab.client, "eth0", v).0;
    assert_eq!(events(kl, "NotHeld"), 0);

    label(kl, true);
    let unanswered = wait_for(Duration::from_secs(10), || (!answered(kl)).then_some(()));
    assert!(unanswered.is_some(), "{v} still answered with every node labelled {LABEL}\n{}", kl.lab.agent_logs());
    let c = pool_held(kl, "False");
    let msg = c["message"].as_str().unwrap_or_default();
    assert!(msg.contains(&v.to_string()) && msg.contains(&format!("labelled {LABEL}")), "the pool's Held condition names the VIP and why: {c}");
    assert!(wait_for(Duration::from_secs(10), || (events(kl, "NotHeld") == 1).then_some(())).is_some(), "no NotHeld Event on web");
    vip_status(kl, v, "not held", |s| s["conditions"][0]["status"] == "False");
    let unowned = r#"vip_pool_vips_unowned{pool="lab"} 1"#;
    let every = wait_for(Duration::from_secs(10), || (0..kl.lab.nodes.len()).all(|i| kl.lab.metrics(i).contains(unowned)).then_some(()));
    assert!(every.is_some(), "not every agent exports {unowned}: {:?}", (0..kl.lab.nodes.len()).map(|i| kl.lab.metrics(i)).collect::<Vec<_>>());

    // An agent (re)started on a node the model leaves out, as a DaemonSet's pod
    // on a Node not Ready or not registered yet: it waits, neither exiting (a
    // crash-looping pod) nor attaching, and joins once the Node is let in. Not the
    // elected controller's: its successor would wait for the Lease to expire.
    let lease = kl.api.get("leases.coordination.k8s.io", Some("vip-system"), "vip-controller").expect("a Lease");
    let r = kl.lab.nodes.iter().position(|n| lease["spec"]["holderIdentity"] != n.name.as_str()).unwrap();
    kl.lab.stop_agent(r, libc::SIGTERM);
    // Its log is appended to: only what the new agent writes counts.
    let log_from = std::fs::metadata(&kl.lab.nodes[r].log).unwrap().len() as usize;
    let new_log =
        |kl: &KubeLab| std::fs::read(&kl.lab.nodes[r].log).map(|b| String::from_utf8_lossy(&b[log_from.min(b.len())..]).into_owned()).unwrap_or_default();
    kl.lab.start_agent(r).unwrap();
    let waiting = wait_for(Duration::from_secs(10), || Some(new_log(kl)).filter(|l| l.contains("waiting for it")));
    assert!(waiting.is_some(), "the restarted agent does not say it waits to be in the model\n{}", kl.lab.agent_logs());
    // Past /healthz's 10 s without a liveness turn: a waiting agent stays healthy
    // (a liveness probe would restart it) and is ready as idle, so that a
    // DaemonSet's rollout does not wait on it (kubeadm's control-plane nodes).
    std::thread::sleep(Duration::from_secs(11));
    kl.lab.nodes[r].agent.as_mut().unwrap().check_alive().unwrap();
    let probe = |path: &str| vip_tests::cluster::http_get(&kl.lab.nodes[r].ns, "127.0.0.1:9472".parse().unwrap(), path).unwrap();
    let (healthz, readyz) = (probe("/healthz"), probe("/readyz"));
    assert_eq!(healthz.0, 200, "/healthz of a waiting agent: {healthz:?}");
    assert!(readyz.0 == 200 && readyz.1.contains("idle"), "/readyz of a waiting agent: {readyz:?}");

    label(kl, false);
    let back = wait_for(Duration::from_secs(10), || answered(kl).then_some(()));
    assert!(back.is_some(), "{v} not answered again once the labels went\n{}", kl.lab.agent_logs());
    pool_held(kl, "True");
    assert!(wait_for(Duration::from_secs(10), || (events(kl, "Held") == 1).then_some(())).is_some(), "no Held Event on web");
    assert_eq!(events(kl, "NotHeld"), 1, "one Warning for the whole episode");
    vip_status(kl, v, "held again", |s| s["conditions"][0]["status"] == "True" && s["holder"].is_string());
    let all: Vec<usize> = (0..kl.lab.nodes.len()).collect();
    kl.lab.wait_converged_on(&all, 1, Duration::from_secs(10)).unwrap_or_else(|e| panic!("the restarted agent did not join: {e:#}\n{}", kl.lab.agent_logs()));
    let log = new_log(kl);
    assert!(log.contains("this node is in the cluster's model now"), "the restarted agent:\n{log}");
}

/// The addresses of the Services in `shop`, by name.
fn addresses(kl: &KubeLab) -> BTreeMap<String, Option<String>> {
    kl.api
        .list("services", Some("shop"))
        .iter()
        .map(|s| (s["metadata"]["name"].as_str().unwrap_or_default().to_owned(), s["status"]["loadBalancer"]["ingress"][0]["ip"].as_str().map(str::to_owned)))
        .collect()
}

/// SIGKILL kube-apiserver, 30 s down with new connections to the VIP every 150 ms,
/// restart on the same etcd; then no address changed and a new Service gets one.
fn outage(kl: &KubeLab) {
    let (lab, api) = (&kl.lab, &kl.api);
    let server = api.real().unwrap();
    api.insert("services", lb_service("shop", "api", false)).unwrap();
    let second = wait_for(Duration::from_secs(20), || {
        api.get("services", Some("shop"), "api")?["status"]["loadBalancer"]["ingress"][0]["ip"].as_str().map(str::to_owned)
    });
    assert_eq!(second.as_deref(), Some(vip(1).to_string().as_str()), "the second Service\n{}", lab.agent_logs());
    let before = addresses(kl);
    assert_eq!(before.len(), 2, "{before:?}");
    assert!(ask(&lab.client, vip(0), 47000, Duration::from_secs(2)).is_ok(), "the VIP answers before the outage");

    let down = Duration::from_secs(30);
    let probes = spawn_probes(&lab.client, vip(0), Duration::from_millis(150), down, Duration::from_secs(1)).unwrap();
    let t0 = Instant::now();
    server.kill();
    std::thread::sleep(down.saturating_sub(t0.elapsed()));
    let attempts = probes.join().expect("the probe thread");
    let failed = attempts.iter().filter(|(_, ok)| ok.is_none()).count();
    eprintln!("API outage: kube-apiserver down {:.1} s; {} connections to {} attempted, {failed} failed", t0.elapsed().as_secs_f64(), attempts.len(), vip(0));
    let restart = server.restart().unwrap_or_else(|e| panic!("restarting kube-apiserver: {e:#}"));
    eprintln!("API outage: kube-apiserver restarted on the same etcd, ready in {:.1} s", restart.as_secs_f64());
    assert!(attempts.len() >= 150, "only {} attempts", attempts.len());
    assert_eq!(failed, 0, "connections failed while the API server was down");

    // Nothing re-allocated; a Service made after the restart gets the free address.
    assert_eq!(addresses(kl), before, "addresses changed over the outage");
    let t1 = Instant::now();
    api.insert("services", lb_service("shop", "late", false)).unwrap();
    let late = wait_for(Duration::from_secs(60), || {
        api.get("services", Some("shop"), "late")?["status"]["loadBalancer"]["ingress"][0]["ip"].as_str().map(str::to_owned)
    });
    let took = t1.elapsed();
    let late = late.unwrap_or_else(|| panic!("the Service made after the restart got no address within 60 s\n{}", lab.agent_logs()));
    eprintln!("API outage: a Service created after the restart was addressed ({late}) {:.1} s after its creation (resync bound: 30 s)", took.as_secs_f64());
    assert_eq!(late, vip(2).to_string());
    let after = addresses(kl);
    for (name, ip) in &before {
        assert_eq!(after.get(name), Some(ip), "{name} changed: {before:?} → {after:?}");
    }
    let answered = wait_for(Duration::from_secs(20), || ask(&lab.client, vip(2), 47001, Duration::from_secs(1)).ok());
    assert!(answered.is_some(), "the new Service's address does not answer\n{}", lab.agent_logs());
}

/// The scenario, on either server.
fn scenario(kl: &KubeLab) {
    let (lab, api) = (&kl.lab, &kl.api);
    api.insert(
        "vippools.vip.dev",
        json!({
            "apiVersion": "vip.dev/v1alpha1", "kind": "VipPool", "metadata": { "name": "lab" },
            "spec": { "addresses": [format!("{}-{}", vip(0), vip(2))], "nodeSelector": { "lab": "yes" }, "tableSize": 251,
                      "healthCheck": { "type": "http", "path": "/healthz", "interval": "200ms", "timeout": "100ms" } }
        }),
    )
    .unwrap();
    api.insert("services", lb_service("shop", "web", false)).unwrap();

    // The leader allocates the lowest address and reports the pool.
    let ip = wait_for(Duration::from_secs(20), || {
        api.get("services", Some("shop"), "web")?["status"]["loadBalancer"]["ingress"][0]["ip"].as_str().map(str::to_owned)
    });
    let ip = ip.unwrap_or_else(|| panic!("no address allocated\n{}", lab.agent_logs()));
    assert_eq!(ip, vip(0).to_string());
    let pool_ok = wait_for(Duration::from_secs(10), || {
        let p = api.get("vippools.vip.dev", None, "lab")?;
        let ready = p["status"]["conditions"].as_array()?.iter().any(|c| c["type"] == "Ready" && c["status"] == "True");
        (ready && p["status"]["allocated"] == 1 && p["status"]["free"] == 2).then_some(())
    });
    assert!(pool_ok.is_some(), "pool status: {:?}", api.get("vippools.vip.dev", None, "lab"));
    // On the stand-in the agents run as pods do (in-cluster config, HTTPS, the
    // ServiceAccount's CA): every one reached the API through the Service address.
    for i in 0..lab.nodes.len() {
        if kl.via_kubernetes_service(i) == Some(0) {
            let ss = lab.nodes[i].ns.cmd("ss").arg("-tn").output().map(|o| String::from_utf8_lossy(&o.stdout).into_owned());
            panic!("{} never connected to the kubernetes Service: {ss:?}", lab.nodes[i].name);
        }
    }
    let lease = api.get("leases.coordination.k8s.io", Some("vip-system"), "vip-controller").expect("a Lease");
    assert!(lab.nodes.iter().any(|n| lease["spec"]["holderIdentity"] == n.name.as_str()), "{lease}");

    // Every agent built the same model and agrees on the owners; the VIP answers.
    let all: Vec<usize> = (0..lab.nodes.len()).collect();
    // Only the allocated address is held: the pool's two free ones are answered by nobody.
    let owners = lab.wait_converged_on(&all, 1, Duration::from_secs(10)).unwrap_or_else(|e| panic!("{e:#}\n{}", lab.agent_logs()));
    assert_eq!(owners.keys().copied().collect::<Vec<_>>(), [vip(0)]);
    for free in [vip(1), vip(2)] {
        let (answered, out) = vip_tests::netns::arping(&lab.client, "eth0", free);
        assert!(!answered, "free address {free} answered:\n{out}");
    }
    let v = vip(0);
    let mut seen = BTreeMap::<String, u32>::new();
    for p in 0..30 {
        *seen.entry(ask(&lab.client, v, 45000 + p, Duration::from_secs(2)).unwrap()).or_default() += 1;
    }
    assert_eq!(seen.keys().map(String::as_str).collect::<Vec<_>>(), ["node-1", "node-2", "node-3"], "{seen:?}");
    let owner_mac = lab.nodes[lab.index_of(&owners[&v])].mac;
    assert_eq!(lab.client_neigh(v), Some(owner_mac), "answered by its owner {}", owners[&v]);
    let events = api.list("events.events.k8s.io", None);
    assert!(events.iter().any(|e| e["reason"] == "Allocated" && e["regarding"]["name"] == "web"), "{events:?}");
    let in_status = wait_for(Duration::from_secs(10), || {
        (api.get("vippools.vip.dev", None, "lab")?["status"]["owners"] == json!({ v.to_string(): owners[&v] })).then_some(())
    });
    assert!(in_status.is_some(), "pool owners: {:?}, agents: {owners:?}", api.get("vippools.vip.dev", None, "lab"));
    let s = vip_status(kl, v, "held by its owner with every node a backend", |s| {
        s["holder"] == owners[&v].as_str() && s["backends"].as_array().is_some_and(|b| b.len() == 3)
    });
    assert_eq!((s["interface"].as_str(), &s["vlan"], &s["backends"]), (Some("eth0"), &json!(null), &json!(["node-1", "node-2", "node-3"])), "{s}");
    assert!(s["heldSince"].is_string() && s["lastGratuitousArp"].is_string(), "{s}");
    let held = &s["conditions"][0];
    assert_eq!((held["type"].as_str(), held["status"].as_str(), held["reason"].as_str()), (Some("Held"), Some("True"), Some("Held")), "{s}");

    // Local policy: only nodes with ready endpoints (checked on healthCheckNodePort).
    api.insert("endpointslices.discovery.k8s.io", endpoint_slice("shop", "web", &["node-2", "node-3"])).unwrap();
    api.insert(
        "services",
        json!({
            "apiVersion": "v1", "kind": "Service", "metadata": { "name": "web", "namespace": "shop" },
            "spec": { "type": "LoadBalancer", "externalTrafficPolicy": "Local", "healthCheckNodePort": HEALTH_CHECK_NODE_PORT, "ports": [{ "port": 80, "protocol": "TCP" }] },
            "status": { "loadBalancer": { "ingress": [{ "ip": ip }] } }
        }),
    )
    .unwrap();
    for nodes in [&["node-2", "node-3"][..], &["node-1"][..]] {
        api.insert("endpointslices.discovery.k8s.io", endpoint_slice("shop", "web", nodes)).unwrap();
        let want: Vec<String> = nodes.iter().map(|n| n.to_string()).collect();
        let applied = wait_for(Duration::from_secs(10), || all.iter().all(|&i| ring_backends(lab, i, "shop/web").as_ref() == Some(&want)).then_some(()));
        assert!(
            applied.is_some(),
            "rings are not {want:?}: {:?}\n{}",
            all.iter().map(|&i| ring_backends(lab, i, "shop/web")).collect::<Vec<_>>(),
            lab.agent_logs()
        );
        let mut seen = BTreeMap::<String, u32>::new();
        for p in 0..10 {
            *seen.entry(ask(&lab.client, v, 46000 + p, Duration::from_secs(2)).unwrap()).or_default() += 1;
        }
        assert_eq!(seen.keys().cloned().collect::<Vec<_>>(), want, "connections with endpoints on {want:?}: {seen:?}");
        // The VipStatus's backends follow the rings.
        vip_status(kl, v, &format!("spread to {want:?}"), |s| s["backends"] == json!(want));
    }
}
