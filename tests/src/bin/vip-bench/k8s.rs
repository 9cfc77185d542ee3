//! Kubernetes. Against a real kube-apiserver and etcd (binaries from
//! `KUBEBUILDER_ASSETS`, run by the tests' harness: TLS, RBAC, the controller and the
//! agents on the deploy/10-rbac.yaml ServiceAccount's token): the allocation rate of
//! one elected controller for 1,000 Services; in the lab with three real agents
//! ([`KubeLab::start_real`]) EndpointSlice change → rings on every agent, an API
//! server outage (SIGKILL, 30 s down, restart on the same etcd) → a new Service
//! addressed, and agent memory with 1,000 Services and 100 Nodes. Against the
//! stand-in: the outage with the watch history compacted (every resumed watch gets
//! 410), which a real server cannot be made to do on demand.
use std::{
    collections::{BTreeMap, BTreeSet},
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result};
use futures_util::{StreamExt as _, TryStreamExt as _};
use http::Method;
use k8s_openapi::api::core::v1::Service;
use kube::{
    runtime::{watcher, WatchStreamExt as _},
    Api,
};
use serde_json::{json, Value};
use vip_agent::k8s::controller::{self, AgentView};
use vip_tests::{
    agent::{wait_for, TempDir},
    halab::{vip, HaSpec},
    kubeapi::{assets, ensure_namespace, raw, resource_path, RealApiServer},
    kubefix::outage_then_new_service,
    kubelab::{apply_at, endpoint_slice, lb_service, node_object, register_node, ring_backends, KubeLab},
};

use crate::{
    measure::{rss_mib, Dist},
    report::{at, line, Line, Section},
};

/// The namespace of the bench's Services.
const NS: &str = "bench";
/// How long the API server is down in the outage rows.
const OUTAGE: Duration = Duration::from_secs(30);

fn pool(addresses: &str) -> Value {
    json!({ "apiVersion": "vip.dev/v1alpha1", "kind": "VipPool", "metadata": { "name": "bench" },
            "spec": { "addresses": [addresses], "nodeSelector": { "lab": "yes" }, "tableSize": 251 } })
}

fn runtime() -> Result<tokio::runtime::Runtime> {
    Ok(tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?)
}

pub fn section() -> Result<Section> {
    let mut s = Section::new(line!("Kubernetes"));
    if assets().is_none() {
        let why = "KUBEBUILDER_ASSETS is not set: set it to a directory holding kube-apiserver and etcd (controller-runtime's envtest layout; `setup-envtest use` downloads one)";
        eprintln!("vip-bench k8s: the real-server rows are not run: {why}");
        s.para(
            line!("**Not run against a real kube-apiserver**: {why}. Only the stand-in's outage row below was measured.")
                .with(at("k8s_real_server").data(json!({ "run": false, "reason": why }))),
        );
        s.para(stand_in_outage()?);
        return Ok(s);
    }
    let (intro, allocation) = allocation()?;
    let stand_in = stand_in_outage()?;
    let [slices, outage, memory] = in_the_lab()?;
    for l in [intro, allocation, slices, outage, stand_in, memory] {
        s.para(l);
    }
    Ok(s)
}

/// The server's name for the `server` field of each row.
fn real_name(server: &RealApiServer) -> String {
    format!("kube-apiserver {}", server.version())
}

/// Allocation: a server of its own on loopback, 1,000 Services made, then the
/// controller started (as the agent's ServiceAccount) and timed until a watch has
/// seen every Service addressed. Also the intro line (the server, its start-up).
fn allocation() -> Result<(Line, Line)> {
    let server = RealApiServer::start().context("KUBEBUILDER_ASSETS")?;
    let tmp = TempDir::new("vip-bench-kube-")?;
    let kubeconfig = tmp.0.join("kubeconfig");
    let (srv, kc) = (&server, &kubeconfig);
    server.block_on(|c| async move {
        srv.install_crd(&c).await?;
        srv.service_account_kubeconfig(&c, "vip-system", "vip-agent", kc).await?;
        ensure_namespace(&c, NS).await?;
        apply_at(&c, "vippools.vip.dev", &pool("198.18.8.0/22")).await?;
        for i in 0..1000 {
            apply_at(&c, "services", &lb_service(NS, &format!("s{i:04}"), false)).await?;
        }
        Ok(())
    })?;
    let (ips, took) = runtime()?.block_on(async {
        let client = vip_agent::k8s::kube_client(Some(&kubeconfig)).await?;
        let services: Api<Service> = Api::namespaced(server.admin_client().await, NS);
        let mut seen = watcher(services, watcher::Config::default()).applied_objects().boxed();
        let (_lead, leading) = tokio::sync::watch::channel(true);
        let t = Instant::now();
        let task = tokio::spawn(controller::run(client, "bench".into(), leading, Duration::from_secs(30), AgentView::fixed(Default::default()).1));
        let mut ips = BTreeMap::new();
        let deadline = tokio::time::Instant::from_std(t + Duration::from_secs(300));
        while ips.len() < 1000 {
            let Ok(next) = tokio::time::timeout_at(deadline, seen.try_next()).await else { break };
            let svc = next?.context("the watch ended")?;
            let ip = svc.status.and_then(|s| s.load_balancer?.ingress?.first()?.ip.clone());
            if let (Some(name), Some(ip)) = (svc.metadata.name, ip) {
                ips.insert(name, ip);
            }
        }
        let took = t.elapsed();
        task.abort();
        anyhow::Ok((ips, took))
    })?;
    let distinct = ips.values().collect::<BTreeSet<_>>().len();
    anyhow::ensure!(ips.len() == 1000 && distinct == 1000, "{} of 1000 Services addressed, {distinct} distinct addresses", ips.len());
    let (name, secs) = (real_name(&server), took.as_secs_f64());
    let a = at("k8s_allocation");
    let allocation = line!(
        "Allocation ({name}): {} LoadBalancer Services, one pool, one elected controller on the agent's ServiceAccount (from its start, including the initial lists): all allocated, distinct, in {} s ({} Services/s; each is one status patch with a resourceVersion precondition and one Event; timed by a watch on the Services).",
        a.f("services").fig(1000, "1,000".into()),
        a.f("seconds").num(secs, 2),
        a.f("per_second").num(1000.0 / secs, 0)
    )
    .with(a.f("server").data(&name));
    let a = at("k8s_real_server");
    let version = server.version().to_owned();
    let intro = line!(
        "Real server: kube-apiserver {} and etcd from `KUBEBUILDER_ASSETS`, started by the tests' harness (TLS, RBAC; the controller and the agents act as deploy/10-rbac.yaml's ServiceAccount), ready {} s after start. Each row names the server it ran against; one run, medians where a distribution is given.",
        a.f("version").show(version),
        a.f("startup_s").num(server.startup().as_secs_f64(), 1)
    )
    .with(a.f("run").data(true));
    Ok((intro, allocation))
}

/// The stand-in stopped for OUTAGE, then back with its watch history compacted:
/// the agent's election and controller at default timing, in this process.
fn stand_in_outage() -> Result<Line> {
    let o = runtime()?.block_on(outage_then_new_service(OUTAGE))?;
    let a = at("k8s_resync");
    Ok(line!(
        "API server down {} s (stand-in: stopped, then back with its watch history compacted: every resumed watch gets 410) → a Service created at once is addressed {} s after the server is back (target ≤ 5 s); leading and reachable again after {} s.",
        a.f("outage_s").show(OUTAGE.as_secs()),
        a.f("addressed_after_s").num(o.addressed_after.as_secs_f64(), 2),
        a.f("leading_again_s").num(o.leading_again_after.as_secs_f64(), 2)
    )
    .with(a.f("server").data("stand-in")))
}

/// The Service's ingress address, if it has one.
async fn address(client: &kube::Client, name: &str) -> Result<Option<String>> {
    let s = raw(client, Method::GET, &format!("{}/{name}", resource_path("services", Some(NS))), "", None).await?.ok()?;
    Ok(s["status"]["loadBalancer"]["ingress"][0]["ip"].as_str().map(str::to_owned))
}

/// The lab with three real agents and a real server: EndpointSlice changes, the
/// outage, then memory with 1,000 Services and 100 Nodes.
fn in_the_lab() -> Result<[Line; 3]> {
    let kl = KubeLab::start_real(HaSpec::default(), &std::env::current_exe()?)?.context("KUBEBUILDER_ASSETS")?;
    let (lab, api) = (&kl.lab, &kl.api);
    let server = api.real().context("a real server")?;
    let name = real_name(server);
    server.block_on(|c| async move { ensure_namespace(&c, NS).await })?;
    api.insert("vippools.vip.dev", pool(&format!("{}-{}", vip(0), vip(2))))?;

    // EndpointSlice change → rings on every agent.
    let slice = |nodes: &[&str]| endpoint_slice(NS, "web", nodes);
    api.insert("endpointslices.discovery.k8s.io", slice(&["node-1", "node-2"]))?;
    api.insert("services", lb_service(NS, "web", true))?;
    let all: Vec<usize> = (0..lab.nodes.len()).collect();
    let ring = format!("{NS}/web");
    let want0 = vec!["node-1".to_owned(), "node-2".to_owned()];
    wait_for(Duration::from_secs(20), || all.iter().all(|&i| ring_backends(lab, i, &ring).as_ref() == Some(&want0)).then_some(()))
        .with_context(|| format!("agents never saw the Local service\n{}", lab.agent_logs()))?;
    let mut lat = Vec::new();
    for k in 0..20 {
        let nodes: &[&str] = if k % 2 == 0 { &["node-2", "node-3"] } else { &["node-1", "node-2"] };
        let want: Vec<String> = nodes.iter().map(|s| s.to_string()).collect();
        let change = slice(nodes);
        let t = server.block_on(|c| async move {
            // Timed from the request on a connection already made.
            raw(&c, Method::GET, "/version", "", None).await?.ok()?;
            let t = Instant::now();
            apply_at(&c, "endpointslices.discovery.k8s.io", &change).await?;
            Ok(t)
        })?;
        let mut pending = all.clone();
        while !pending.is_empty() && t.elapsed() < Duration::from_secs(10) {
            pending.retain(|&i| {
                let seen = ring_backends(lab, i, &ring).as_ref() == Some(&want);
                if seen {
                    lat.push(t.elapsed().as_secs_f64() * 1e3);
                }
                !seen
            });
            std::thread::sleep(Duration::from_millis(2));
        }
        anyhow::ensure!(pending.is_empty(), "agents {pending:?} did not apply EndpointSlice change {k}");
    }
    let a = at("k8s_endpointslice_to_maps_ms");
    let [m, p, x] = Dist::of(&lat).figs(&a, 1.0, 0);
    let slices = line!(
        "EndpointSlice change ({name}; Local policy: the Service's backend nodes change) → the agent's status shows the new ring written, on each of 3 agents, 20 changes, timed from the apply request (on an open connection): median {} ms, p95 {} ms, max {} ms (2 ms polling of the status files; target ≤ 100 ms median).",
        m,
        p,
        x
    )
    .with(a.f("samples").data(&lat))
    .with(a.f("server").data(&name));

    // The outage: SIGKILL, OUTAGE down, restart on the same etcd; a Service created
    // once the server is ready.
    server.kill();
    std::thread::sleep(OUTAGE);
    let restart = server.restart()?;
    let back = Instant::now();
    let addressed = server.block_on(|c| async move {
        apply_at(&c, "services", &lb_service(NS, "late", false)).await?;
        while back.elapsed() < Duration::from_secs(120) {
            if address(&c, "late").await?.is_some() {
                return Ok(back.elapsed());
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        anyhow::bail!("the Service created after the restart got no address within 120 s")
    })?;
    let a = at("k8s_resync_real");
    let outage = line!(
        "API server down {} s ({name}: SIGKILLed with the three agents running, restarted on the same etcd, ready {} s after the restart) → a Service created once it is ready is addressed {} s after it was ready (20 ms polling; target ≤ 5 s).",
        a.f("outage_s").show(OUTAGE.as_secs()),
        a.f("restart_ready_s").num(restart.as_secs_f64(), 2),
        a.f("addressed_after_s").num(addressed.as_secs_f64(), 2)
    )
    .with(a.f("server").data(&name));

    // Memory with 1,000 Services (addressed by the lab's elected agent) and 100 Nodes.
    api.insert("vippools.vip.dev", pool("198.18.8.0/22"))?;
    server.block_on(|c| async move {
        for i in 0..97 {
            register_node(&c, &node_object(&format!("node-x{i:02}"), &format!("198.18.2.{}", i + 1))).await?;
        }
        for i in 0..1000 {
            apply_at(&c, "services", &lb_service(NS, &format!("m{i:04}"), false)).await?;
        }
        Ok(())
    })?;
    wait_for(Duration::from_secs(180), || all.iter().all(|&i| lab.status(i).is_some_and(|s| s.services.len() >= 1000)).then_some(()))
        .with_context(|| format!("agents never reached 1,000 services\n{}", lab.agent_logs()))?;
    std::thread::sleep(Duration::from_secs(3)); // settle (heartbeats, MAC retries, GARP rounds)
    let rss: Vec<f64> = lab.nodes.iter().filter_map(|n| rss_mib(n.agent.as_ref()?.child.id())).collect();
    anyhow::ensure!(rss.len() == 3, "could not read the agents' RSS");
    let max = rss.iter().cloned().fold(0.0, f64::max);
    let (r0, r1, r2) = (rss[0], rss[1], rss[2]);
    let a = at("k8s_rss_mib");
    let memory = line!(
        "Agent memory (VmRSS; {name}) with 1,000 Services and 100 Nodes (1,024-address pool, rings of 251 slots; the Services addressed by the lab's elected agent): {r0:.1} / {r1:.1} / {r2:.1} MiB on the three agents, max {} MiB (target ≤ 64 MiB).",
        a.f("max").num(max, 1)
    )
    .with(a.f("agents").data(&rss))
    .with(a.f("server").data(&name));
    Ok([slices, outage, memory])
}
