//! The agent's Kubernetes controller (real kube client code) against the API
//! stand-in: allocation with exclusions, pinned and requested addresses, pools
//! that are invalid or overlap (conditions), pools edited live, release on type
//! change, Events, and a leader change in the middle of allocations without any
//! address handed out twice.
//!
//! Every scenario runs twice: `NAME::stand_in` against the in-process stand-in and
//! `NAME::real` against a real kube-apiserver (`vip_tests::kubeapi`; one per test
//! binary, scenarios serialised on it, skipped without `KUBEBUILDER_ASSETS` unless
//! CI=true).
use std::{collections::BTreeMap, time::Duration};

use k8s_openapi::api::core::v1::Service;
use kube::{
    api::{Api, Patch, PatchParams, PostParams},
    ResourceExt,
};
use serde_json::{json, Value};
use tokio::sync::watch;
use vip_agent::k8s::{
    controller,
    crd::VipPool,
    leader::{self, LeaderConfig},
};
use vip_tests::{
    kubeapi::Backend,
    kubefix::{events, eventually, ingress_ips, pool_condition, run_controller, vip_pool},
};

vip_tests::both_api_servers!(allocates_reports_pools_and_follows_live_edits);
vip_tests::both_api_servers!(leader_change_mid_allocation_hands_out_no_address_twice);
vip_tests::both_api_servers!(pool_status_lists_owners_of_vips_in_use_and_owner_changes_are_events);
vip_tests::both_api_servers!(unprogrammed_services_are_reported_on_the_pool_and_the_service);
vip_tests::both_api_servers!(vips_no_node_holds_are_reported_on_the_pool_and_the_service);
vip_tests::both_api_servers!(arp_conflicts_are_a_condition_and_an_event_and_held_since_survives_a_restart);

fn lb(name: &str, port: i32, annotations: Value) -> Service {
    serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Service",
        "metadata": { "name": name, "namespace": "shop", "annotations": annotations },
        "spec": { "type": "LoadBalancer", "ports": [{ "port": port, "protocol": "TCP" }] }
    }))
    .unwrap()
}

async fn allocates_reports_pools_and_follows_live_edits(api: Backend) {
    let client = api.client().await;
    api.insert("namespaces", json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "shop", "labels": {"env": "prod"}}})).unwrap();
    let pools: Api<VipPool> = Api::all(client.clone());
    let pp = PostParams::default();
    pools.create(&pp, &vip_pool("auto", json!({"addresses": ["198.18.1.10-198.18.1.12"], "excludedIPs": ["198.18.1.11"]}))).await.unwrap();
    pools.create(&pp, &vip_pool("manual", json!({"addresses": ["198.18.1.20/31"], "autoAssign": false}))).await.unwrap();
    pools.create(&pp, &vip_pool("broken", json!({"addresses": ["198.18.2.1", "198.18.2.300"]}))).await.unwrap();
    pools.create(&pp, &vip_pool("overlapping", json!({"addresses": ["198.18.1.12-198.18.1.13"]}))).await.unwrap();
    let svcs: Api<Service> = Api::namespaced(client.clone(), "shop");
    // Created within one second: creationTimestamp ties (it has second resolution,
    // as on a real server), so the allocator orders them by name: api, asks, third, web.
    for s in [lb("web", 80, json!({})), lb("api", 443, json!({})), lb("asks", 80, json!({"vip.dev/address": "198.18.1.21"})), lb("third", 8080, json!({}))] {
        svcs.create(&pp, &s).await.unwrap();
    }
    let mut clusterip = lb("internal", 80, json!({}));
    clusterip.spec.as_mut().unwrap().type_ = Some("ClusterIP".into());
    svcs.create(&pp, &clusterip).await.unwrap();

    let (_lead, task) = run_controller(client.clone());

    let want: BTreeMap<String, String> = [("shop/api", "198.18.1.10"), ("shop/third", "198.18.1.12"), ("shop/asks", "198.18.1.21")]
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    eventually(&format!("api, third and asks allocated: {want:?}"), || ingress_ips(&api) == want).await;
    eventually("auto pool status counts", || {
        api.get("vippools.vip.dev", None, "auto")
            .is_some_and(|p| (p["status"]["total"].clone(), p["status"]["allocated"].clone(), p["status"]["free"].clone()) == (json!(2), json!(2), json!(0)))
    })
    .await;
    assert_eq!(pool_condition(&api, "auto", "Ready").unwrap().0, "True");
    eventually("broken pool not ready", || pool_condition(&api, "broken", "Ready").is_some()).await;
    let (status, msg) = pool_condition(&api, "broken", "Ready").unwrap();
    assert_eq!(status, "False");
    assert!(msg.starts_with("spec.addresses[1]: "), "{msg}");
    eventually("overlapping pool conflicting", || pool_condition(&api, "overlapping", "Conflicting").is_some()).await;
    let (status, msg) = pool_condition(&api, "overlapping", "Conflicting").unwrap();
    assert_eq!(status, "True");
    assert!(msg.contains("198.18.1.12 is also in VipPool \"auto\""), "{msg}");
    eventually("events", || !events(&api, "AllocationFailed").is_empty() && events(&api, "Allocated").len() == 3).await;
    assert!(events(&api, "AllocationFailed").iter().any(|e| e.starts_with("web: no VipPool with autoAssign")), "{:?}", events(&api, "AllocationFailed"));

    // The pool grows: the waiting Service gets the new address.
    pools.patch("auto", &PatchParams::default(), &Patch::Merge(json!({"spec": {"addresses": ["198.18.1.10-198.18.1.12", "198.18.1.30"]}}))).await.unwrap();
    eventually("web allocated after the pool grew", || ingress_ips(&api).get("shop/web").map(String::as_str) == Some("198.18.1.30")).await;
    // The pool narrows: .12 leaves it, so the overlapping pool stops conflicting and
    // now holds .12; third keeps its address (no needless move).
    pools
        .patch("auto", &PatchParams::default(), &Patch::Merge(json!({"spec": {"addresses": ["198.18.1.10", "198.18.1.30"], "excludedIPs": []}})))
        .await
        .unwrap();
    eventually("overlapping pool ready", || pool_condition(&api, "overlapping", "Ready").is_some_and(|c| c.0 == "True")).await;
    assert_eq!(ingress_ips(&api).get("shop/third").map(String::as_str), Some("198.18.1.12"));
    // That pool goes: .12 is in no pool now, third is released and waits.
    pools.delete("overlapping", &Default::default()).await.unwrap();
    eventually("third released", || !ingress_ips(&api).contains_key("shop/third")).await;
    // The controller records the Event after the status write: wait for it too.
    eventually("Released event for third", || events(&api, "Released").iter().any(|e| e.starts_with("third: 198.18.1.12"))).await;
    // A Service that stops being a LoadBalancer gives its address back; third takes it.
    svcs.patch("web", &PatchParams::default(), &Patch::Merge(json!({"spec": {"type": "ClusterIP"}}))).await.unwrap();
    eventually("web released, third gets .30", || {
        let now = ingress_ips(&api);
        !now.contains_key("shop/web") && now.get("shop/third").map(String::as_str) == Some("198.18.1.30")
    })
    .await;
    let all = ingress_ips(&api);
    let distinct: std::collections::BTreeSet<&String> = all.values().collect();
    assert_eq!(distinct.len(), all.len(), "an address handed out twice: {all:?}");
    task.abort();
}

async fn leader_change_mid_allocation_hands_out_no_address_twice(api: Backend) {
    let client = api.client().await;
    let pools: Api<VipPool> = Api::all(client.clone());
    pools.create(&PostParams::default(), &vip_pool("big", json!({"addresses": ["198.18.4.0/26"]}))).await.unwrap();
    let cfg = |id: &str| LeaderConfig {
        lease_duration: Duration::from_millis(1500),
        retry_period: Duration::from_millis(100),
        ..LeaderConfig::new("vip-system", id)
    };
    // Two agents, each with its own client, election and controller.
    let mut agents = Vec::new();
    for id in ["node-1", "node-2"] {
        let c = api.client().await;
        let leading = leader::spawn(c.clone(), cfg(id));
        let watch_lead = leading.clone();
        agents.push((
            id,
            watch_lead,
            tokio::spawn(controller::run(c, id.into(), leading, Duration::from_millis(500), controller::AgentView::fixed(BTreeMap::new()).1)),
        ));
    }
    eventually("exactly one leader", || agents.iter().filter(|(_, l, _)| *l.borrow()).count() == 1).await;
    let first = agents.iter().position(|(_, l, _)| *l.borrow()).unwrap();
    let svcs: Api<Service> = Api::namespaced(client.clone(), "shop");
    for i in 0..20 {
        svcs.create(&PostParams::default(), &lb(&format!("s{i:02}"), 80, json!({}))).await.unwrap();
    }
    eventually("some allocated", || ingress_ips(&api).len() >= 5).await;
    // The leader dies (its controller and, with it, its lease renewals stop).
    let (dead, dead_lead, task) = agents.remove(first);
    task.abort();
    drop(dead_lead);
    for i in 20..40 {
        svcs.create(&PostParams::default(), &lb(&format!("s{i:02}"), 80, json!({}))).await.unwrap();
    }
    eventually("the other agent leads", || *agents[0].1.borrow()).await;
    eventually("all 40 allocated", || ingress_ips(&api).len() == 40).await;
    let all = ingress_ips(&api);
    let distinct: std::collections::BTreeSet<&String> = all.values().collect();
    assert_eq!(distinct.len(), 40, "an address handed out twice: {all:?}");
    let lease = api.get("leases.coordination.k8s.io", Some("vip-system"), "vip-controller").unwrap();
    assert_ne!(lease["spec"]["holderIdentity"], json!(dead), "the lease moved away from {dead}");
    assert!(lease["spec"]["leaseTransitions"].as_i64().unwrap() >= 1);
    let names: Vec<String> = svcs.list(&Default::default()).await.unwrap().items.iter().map(|s| s.name_any()).collect();
    assert_eq!(names.len(), 40);
    agents[0].2.abort();
}

async fn pool_status_lists_owners_of_vips_in_use_and_owner_changes_are_events(api: Backend) {
    let client = api.client().await;
    let pp = PostParams::default();
    Api::<VipPool>::all(client.clone()).create(&pp, &vip_pool("p", json!({"addresses": ["198.18.1.10-198.18.1.11"]}))).await.unwrap();
    Api::<Service>::namespaced(client.clone(), "shop").create(&pp, &lb("web", 80, json!({}))).await.unwrap();
    // The agent's view: every address of the pool has an owner; only .10 is in use.
    let owners = |a: &str| [("198.18.1.10".parse().unwrap(), a.to_owned()), ("198.18.1.11".parse().unwrap(), "node-b".to_owned())].into();
    let (owners_tx, view) = controller::AgentView::fixed(owners("node-a"));
    let (_lead, leading) = watch::channel(true);
    let task = tokio::spawn(controller::run(client.clone(), "node-1".into(), leading, Duration::from_secs(1), view));
    let status_owners = |api: &Backend| api.get("vippools.vip.dev", None, "p").map(|p| p["status"]["owners"].clone()).unwrap_or(Value::Null);

    eventually("the VIP in use and its owner in the pool status", || status_owners(&api) == json!({"198.18.1.10": "node-a"})).await;
    assert!(events(&api, "OwnerChanged").is_empty(), "a first owner is no move: {:?}", events(&api, "OwnerChanged"));

    owners_tx.send(owners("node-c")).unwrap();
    eventually("the new owner in the pool status", || status_owners(&api) == json!({"198.18.1.10": "node-c"})).await;
    eventually("an Event for the move", || events(&api, "OwnerChanged") == ["web: 198.18.1.10 is now held by node node-c (was node-a)"]).await;

    // A new leader starts from the status: it repeats no Event.
    task.abort();
    let (_owners_tx2, view) = controller::AgentView::fixed(owners("node-c"));
    let (_lead2, leading) = watch::channel(true);
    let task = tokio::spawn(controller::run(client.clone(), "node-2".into(), leading, Duration::from_millis(200), view));
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert_eq!(events(&api, "OwnerChanged").len(), 1, "{:?}", events(&api, "OwnerChanged"));

    // The Service goes away: its VIP leaves the owners.
    Api::<Service>::namespaced(client.clone(), "shop").delete("web", &Default::default()).await.unwrap();
    eventually("owners emptied", || status_owners(&api).as_object().is_none_or(|o| o.is_empty())).await;
    task.abort();
}

/// A service-port the agent could not program (ring space, ids) is said where
/// users look: a `Programmed=False` condition on its pool naming it, and one
/// `NotProgrammed` Warning on its Service; both clear when it fits again.
async fn unprogrammed_services_are_reported_on_the_pool_and_the_service(api: Backend) {
    let client = api.client().await;
    api.insert("namespaces", json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "shop"}})).unwrap();
    let pp = PostParams::default();
    Api::<VipPool>::all(client.clone()).create(&pp, &vip_pool("p", json!({"addresses": ["198.18.1.10-198.18.1.11"]}))).await.unwrap();
    let svcs: Api<Service> = Api::namespaced(client.clone(), "shop");
    svcs.create(&pp, &lb("web", 80, json!({}))).await.unwrap();
    let (_owners, mut view) = controller::AgentView::fixed(BTreeMap::new());
    let (unprogrammed, rx) = watch::channel(BTreeMap::new());
    view.unprogrammed = rx;
    let (_lead, leading) = watch::channel(true);
    let task = tokio::spawn(controller::run(client.clone(), "node-1".into(), leading, Duration::from_secs(1), view));
    eventually("web allocated", || ingress_ips(&api).contains_key("shop/web")).await;
    eventually("programmed", || pool_condition(&api, "p", "Programmed").is_some_and(|c| c.0 == "True")).await;
    let vip: std::net::IpAddr = ingress_ips(&api)["shop/web"].parse().unwrap();
    let why = "80/tcp: lb4_ring is full: no room for a 16381-slot ring in 1048576 slots (raise --ring-capacity)".to_owned();
    unprogrammed.send_replace(BTreeMap::from([(vip, vec![why.clone()])]));
    eventually("not programmed", || pool_condition(&api, "p", "Programmed").is_some_and(|c| c.0 == "False")).await;
    let (_, msg) = pool_condition(&api, "p", "Programmed").unwrap();
    assert_eq!(msg, format!("1 service-port(s) not programmed, retried: {vip} {why}"));
    eventually("an Event", || events(&api, "NotProgrammed").len() == 1).await;
    assert_eq!(events(&api, "NotProgrammed"), [format!("web: {vip} is not in the data path, retried: {why}")]);
    // Room again: the condition clears, no further Event.
    unprogrammed.send_replace(BTreeMap::new());
    eventually("programmed again", || pool_condition(&api, "p", "Programmed").is_some_and(|c| c.0 == "True")).await;
    assert_eq!(events(&api, "NotProgrammed").len(), 1);
    task.abort();
}

/// A VIP in use that no node holds (its only node labelled out of load
/// balancers, say) is said where users look: a `Held=False` condition on its pool
/// naming it and why, one `NotHeld` Warning on its Service, and a `Held` Event
/// once a node holds it again.
async fn vips_no_node_holds_are_reported_on_the_pool_and_the_service(api: Backend) {
    let client = api.client().await;
    api.insert("namespaces", json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "shop"}})).unwrap();
    let pp = PostParams::default();
    Api::<VipPool>::all(client.clone()).create(&pp, &vip_pool("p", json!({"addresses": ["198.18.1.10-198.18.1.11"]}))).await.unwrap();
    Api::<Service>::namespaced(client.clone(), "shop").create(&pp, &lb("web", 80, json!({}))).await.unwrap();
    let (owners, mut view) = controller::AgentView::fixed(BTreeMap::new());
    let (unheld, rx) = watch::channel(BTreeMap::new());
    view.unheld = rx;
    let (_lead, leading) = watch::channel(true);
    let task = tokio::spawn(controller::run(client.clone(), "node-1".into(), leading, Duration::from_secs(1), view));
    eventually("web allocated", || ingress_ips(&api).contains_key("shop/web")).await;
    let vip: std::net::IpAddr = ingress_ips(&api)["shop/web"].parse().unwrap();
    owners.send_replace(BTreeMap::from([(vip, "node-1".to_owned())]));
    eventually("held", || pool_condition(&api, "p", "Held").is_some_and(|c| c.0 == "True")).await;

    // node-1 is excluded: the agent tells no node may hold the pool's addresses
    // (both of them; only the one in use is reported).
    let why = r#"no node may hold VipPool "p"'s addresses: none of the 0 node(s) in use matches its nodeSelector and tolerations; left out: node-1 (labelled node.kubernetes.io/exclude-from-external-load-balancers)"#;
    let left_out = vec![("node-1".to_owned(), "labelled node.kubernetes.io/exclude-from-external-load-balancers".to_owned())];
    let no_holder = vip_agent::model::NoHolder::NoEligibleNode { pool: "p".into(), nodes: 0, left_out };
    owners.send_replace(BTreeMap::new());
    let other: std::net::IpAddr = if vip.to_string().ends_with(".10") { "198.18.1.11" } else { "198.18.1.10" }.parse().unwrap();
    unheld.send_replace(BTreeMap::from([(vip, no_holder.clone()), (other, no_holder)]));
    eventually("not held", || pool_condition(&api, "p", "Held").is_some_and(|c| c.0 == "False")).await;
    assert_eq!(pool_condition(&api, "p", "Held").unwrap().1, format!("1 VIP(s) in use held by no node, not answered: {vip}: {why}"));
    eventually("a Warning", || events(&api, "NotHeld").len() == 1).await;
    assert_eq!(events(&api, "NotHeld"), [format!("web: {vip} is answered by no node: {why}")]);
    // The pool's other conditions are unchanged by it.
    assert_eq!(pool_condition(&api, "p", "Programmed").unwrap().0, "True");

    // The label goes: held again, one Held Event, no second Warning.
    unheld.send_replace(BTreeMap::new());
    owners.send_replace(BTreeMap::from([(vip, "node-1".to_owned())]));
    eventually("held again", || pool_condition(&api, "p", "Held").is_some_and(|c| c.0 == "True")).await;
    eventually("a Held Event", || events(&api, "Held").len() == 1).await;
    assert_eq!(events(&api, "Held"), [format!("web: {vip} is held again, by node node-1")]);
    assert_eq!(events(&api, "NotHeld").len(), 1);
    task.abort();
}

/// The holder's VipStatus writer (`vipstatus::run_holder`) with the controller:
/// an ARP self-check that saw a foreign MAC is `ArpConflict=True` naming it and
/// one `ArpConflict` Warning on the Service for the whole episode, however many
/// checks confirm it; a clean check `ArpConflict=False` and one
/// `ArpConflictResolved` Event. Then the writer restarts (a new agent) and finds
/// the VIP held (adopted): `heldSince` stays the take-over time; a VIP taken anew
/// gets its new time.
async fn arp_conflicts_are_a_condition_and_an_event_and_held_since_survives_a_restart(api: Backend) {
    use std::time::{Duration as D, SystemTime};
    use vip_agent::{
        ha::{arpcheck::ArpCheck, HeldVip},
        k8s::vipstatus,
    };
    let client = api.client().await;
    api.insert("namespaces", json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "shop"}})).unwrap();
    let pp = PostParams::default();
    Api::<VipPool>::all(client.clone()).create(&pp, &vip_pool("p", json!({"addresses": ["198.18.1.10"]}))).await.unwrap();
    Api::<Service>::namespaced(client.clone(), "shop").create(&pp, &lb("web", 80, json!({}))).await.unwrap();
    let (owners, view) = controller::AgentView::fixed(BTreeMap::new());
    let (_lead, leading) = watch::channel(true);
    let task = tokio::spawn(controller::run(client.clone(), "node-1".into(), leading, Duration::from_secs(1), view));
    eventually("web allocated", || ingress_ips(&api).contains_key("shop/web")).await;
    let vip: std::net::IpAddr = ingress_ips(&api)["shop/web"].parse().unwrap();
    owners.send_replace(BTreeMap::from([(vip, "node-1".to_owned())]));
    let name = vip_agent::k8s::crd::vip_status_name(vip);
    let status = || api.get("vipstatuses.vip.dev", None, &name).map(|o| o["status"].clone()).unwrap_or_default();
    let arp = || status()["conditions"].as_array().into_iter().flatten().find(|c| c["type"] == "ArpConflict").cloned();

    let t = |s: u64| SystemTime::UNIX_EPOCH + D::from_secs(1_790_000_000 + s);
    let took = HeldVip { since: t(0), last_garp: Some(t(0)), interface: "eth0".into(), vlan: None, adopted: false, arp: None };
    let (held, held_rx) = watch::channel(BTreeMap::from([(vip, took.clone())]));
    let (_backends, backends_rx) = watch::channel(BTreeMap::new());
    let writer = tokio::spawn(vipstatus::run_holder(client.clone(), "node-1".into(), held_rx, backends_rx.clone()));
    eventually("the holder's status", || status()["heldSince"] == "2026-09-21T14:13:20Z" && status()["holder"] == "node-1").await;
    assert_eq!(arp(), None, "no check yet: no condition");

    let check = |foreign: Vec<[u8; 6]>, at: u64, since: u64| ArpCheck { by: "node-2".into(), at: t(at), holder_answered: true, foreign, since: t(since) };
    let rogue = [0x02, 0xde, 0xad, 0, 0, 0x99];
    for at in [30, 75, 120] {
        held.send_replace(BTreeMap::from([(vip, HeldVip { arp: Some(check(vec![rogue], at, 30)), ..took.clone() })]));
        eventually("ArpConflict=True", || arp().is_some_and(|c| c["status"] == "True")).await;
    }
    let c = arp().unwrap();
    assert_eq!((c["reason"].as_str(), c["lastTransitionTime"].as_str()), (Some("ForeignAnswer"), Some("2026-09-21T14:13:50Z")));
    assert!(c["message"].as_str().unwrap().contains("02:de:ad:00:00:99"), "{c}");
    eventually("an ArpConflict Warning", || events(&api, "ArpConflict").len() == 1).await;
    let ev = &events(&api, "ArpConflict")[0];
    assert!(ev.starts_with(&format!("web: {vip}: node node-2 asked")) && ev.contains("02:de:ad:00:00:99"), "{ev}");
    held.send_replace(BTreeMap::from([(vip, HeldVip { arp: Some(check(vec![], 165, 165)), ..took.clone() })]));
    eventually("ArpConflict=False", || arp().is_some_and(|c| c["status"] == "False" && c["reason"] == "HolderOnly")).await;
    eventually("an ArpConflictResolved Event", || events(&api, "ArpConflictResolved").len() == 1).await;
    assert_eq!(events(&api, "ArpConflict").len(), 1, "one Warning for the episode");

    // A new agent on the holder: it found the VIP held at its start.
    writer.abort();
    let _ = writer.await;
    let restarted = HeldVip { since: t(600), adopted: true, ..took.clone() };
    let (held, held_rx) = watch::channel(BTreeMap::from([(vip, restarted.clone())]));
    let writer = tokio::spawn(vipstatus::run_holder(client.clone(), "node-1".into(), held_rx, backends_rx.clone()));
    held.send_replace(BTreeMap::from([(vip, HeldVip { last_garp: Some(t(601)), ..restarted.clone() })]));
    eventually("the new agent's write", || status()["lastGratuitousArp"] == "2026-09-21T14:23:21Z").await;
    assert_eq!(status()["heldSince"], "2026-09-21T14:13:20Z", "the take-over time survives the restart: {}", status());
    assert_eq!(arp(), None, "the new agent has no check yet");
    // Released and taken again: a new take-over time.
    held.send_replace(BTreeMap::from([(vip, HeldVip { since: t(700), adopted: false, ..restarted })]));
    eventually("a new take-over time", || status()["heldSince"] == "2026-09-21T14:25:00Z").await;
    writer.abort();
    task.abort();
}
