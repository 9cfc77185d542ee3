//! End to end with Kubernetes as the source: the API stand-in runs in a namespace
//! of the lab (198.18.0.2), three nodes run the real `vip-agent run --kubernetes`
//! with a kubeconfig pointing at it. A VipPool and a LoadBalancer Service are
//! created through the API: the elected agent allocates the Service an address,
//! the pool reports Ready with its counts, the address answers ARP from exactly
//! one node and connections to it spread over all three nodes; the pool's status
//! names that node; then the Service turns `externalTrafficPolicy: Local` and its
//! EndpointSlice changes move every agent's ring to the nodes with endpoints.
use std::{collections::BTreeMap, path::Path, time::Duration};

use serde_json::json;
use vip_tests::{
    agent::{agent_bin, wait_for},
    halab::{ask, vip, HaSpec},
    kubelab::{endpoint_slice, ring_backends, KubeLab},
    netns::privileged,
};

#[test]
fn service_gets_a_vip_that_answers_and_spreads_over_the_nodes() {
    if !privileged() {
        return;
    }
    agent_bin().expect("the vip-agent binary (cargo xtask test builds it)");
    let kl = KubeLab::start(HaSpec::default(), Path::new(env!("CARGO_BIN_EXE_vip-lab"))).unwrap();
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
    api.insert(
        "services",
        json!({
            "apiVersion": "v1", "kind": "Service", "metadata": { "name": "web", "namespace": "shop" },
            "spec": { "type": "LoadBalancer", "externalTrafficPolicy": "Cluster", "ports": [{ "port": 80, "protocol": "TCP" }] }
        }),
    )
    .unwrap();

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
    let lease = api.get("leases.coordination.k8s.io", Some("vip-system"), "vip-controller").expect("a Lease");
    assert!(lab.nodes.iter().any(|n| lease["spec"]["holderIdentity"] == n.name.as_str()), "{lease}");

    // Every agent built the same model and agrees on the owners; the VIP answers.
    let all: Vec<usize> = (0..lab.nodes.len()).collect();
    let owners = lab.wait_converged(&all, Duration::from_secs(10)).unwrap_or_else(|e| panic!("{e:#}\n{}", lab.agent_logs()));
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

    // Local policy: only nodes with ready endpoints (checked on healthCheckNodePort).
    api.insert("endpointslices.discovery.k8s.io", endpoint_slice("shop", "web", &["node-2", "node-3"])).unwrap();
    api.insert(
        "services",
        json!({
            "apiVersion": "v1", "kind": "Service", "metadata": { "name": "web", "namespace": "shop" },
            "spec": { "type": "LoadBalancer", "externalTrafficPolicy": "Local", "healthCheckNodePort": 80, "ports": [{ "port": 80, "protocol": "TCP" }] },
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
    }
}
