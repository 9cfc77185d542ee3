//! Against a real kube-apiserver and etcd (`vip_tests::kubeapi`, binaries from
//! `$KUBEBUILDER_ASSETS`; skipped without them, except with CI=true): one server
//! for this binary, tests serialised on it.
//!
//! - what `kubectl apply -k deploy/` applies, and deploy/examples/, apply (server-side
//!   apply, dry run first) without a rejection or a warning;
//! - the agent's controller and leader election, acting as the deploy/10-rbac.yaml
//!   ServiceAccount (a TokenRequest token), allocate, record Events and hold the
//!   Lease, and cannot write what the RBAC does not give;
//! - the controller rides out an API server outage (SIGKILL, restart on the same etcd).
use std::{collections::BTreeMap, path::PathBuf, time::Duration};

use http::Method;
use serde_json::{json, Value};
use vip_agent::k8s::{
    controller,
    leader::{self, LeaderConfig},
};
use vip_tests::{
    agent::TempDir,
    kubeapi::{apply, client_from_kubeconfig, deploy_dir, kustomize, manifests, raw, Backend},
    kubefix::{eventually_within, run_controller},
};

fn yaml_files(dir: &std::path::Path) -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> =
        std::fs::read_dir(dir).unwrap().map(|e| e.unwrap().path()).filter(|p| p.extension().is_some_and(|e| e == "yaml" || e == "yml")).collect();
    v.sort();
    v
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn server_version_and_startup() {
    let Some(b) = Backend::real().await else {
        return;
    };
    let Backend::Real { server, .. } = &b else { unreachable!() };
    eprintln!("kube-apiserver {}: ready {:.2} s after start", server.version(), server.startup().as_secs_f64());
    assert!(server.version().starts_with("v1."), "{}", server.version());
    assert!(server.startup() < Duration::from_secs(60));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deploy_manifests_apply_without_rejection_or_warning() {
    let Some(b) = Backend::real().await else {
        return;
    };
    let Backend::Real { server, client, .. } = &b else { unreachable!() };
    // The check can see warnings: a deprecated node label in a pod template draws one.
    let probe = json!({ "apiVersion": "apps/v1", "kind": "Deployment", "metadata": { "name": "warning-probe", "namespace": "default" },
        "spec": { "selector": { "matchLabels": { "app": "probe" } }, "template": { "metadata": { "labels": { "app": "probe" } },
            "spec": { "nodeSelector": { "beta.kubernetes.io/arch": "amd64" }, "containers": [{ "name": "c", "image": "probe" }] } } } });
    let w = apply(client, &probe, true).await.unwrap();
    assert!(w.iter().any(|w| w.contains("beta.kubernetes.io/arch")), "no warning seen for a deprecated label: {w:?}");
    let deploy = deploy_dir();
    // What `kubectl apply -k deploy/` applies, then the examples (they need the CRD).
    let mut sets = vec![("deploy/ (kubectl kustomize)".to_owned(), kustomize(&deploy).unwrap())];
    for f in yaml_files(&deploy.join("examples")) {
        sets.push((f.strip_prefix(deploy.parent().unwrap()).unwrap().display().to_string(), manifests(&f).unwrap()));
    }
    assert!(sets[0].1.len() >= 8, "{:?}", sets[0]);
    let (mut rejected, mut warned, mut applied) = (Vec::new(), Vec::new(), 0);
    for (name, docs) in &sets {
        for doc in docs.clone() {
            let what = format!("{name}: {} {}", doc["kind"].as_str().unwrap_or("?"), doc["metadata"]["name"].as_str().unwrap_or("?"));
            for dry_run in [true, false] {
                match apply(client, &doc, dry_run).await {
                    Ok(w) => warned.extend(w.into_iter().map(|w| format!("{what}{}: {w}", if dry_run { " (dry run)" } else { "" }))),
                    Err(e) => {
                        rejected.push(format!("{what}: {e:#}"));
                        break;
                    }
                }
            }
            applied += 1;
            if doc["kind"] == "CustomResourceDefinition" {
                server.install_crd(client).await.unwrap();
            }
        }
    }
    assert!(rejected.is_empty(), "rejected by kube-apiserver {}:\n{}", server.version(), rejected.join("\n"));
    assert!(warned.is_empty(), "warnings from kube-apiserver {}:\n{}", server.version(), warned.join("\n"));
    eprintln!("{applied} objects applied without a warning");
}

fn pool(name: &str, addresses: &[&str]) -> Value {
    json!({ "apiVersion": "vip.dev/v1alpha1", "kind": "VipPool", "metadata": { "name": name }, "spec": { "addresses": addresses } })
}

fn lb(ns: &str, name: &str) -> Value {
    json!({ "apiVersion": "v1", "kind": "Service", "metadata": { "name": name, "namespace": ns },
            "spec": { "type": "LoadBalancer", "ports": [{ "port": 80, "protocol": "TCP" }] } })
}

fn ip_of(b: &Backend, ns: &str, name: &str) -> Option<String> {
    b.get("services", Some(ns), name)?["status"]["loadBalancer"]["ingress"][0]["ip"].as_str().map(str::to_owned)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn controller_and_election_work_with_exactly_the_deploy_rbac() {
    let Some(b) = Backend::real().await else {
        return;
    };
    let Backend::Real { server, client: admin, .. } = &b else { unreachable!() };
    let tmp = TempDir::new("vip-sa-").unwrap();
    let kc = server.service_account_kubeconfig(admin, "vip-system", "vip-agent", &tmp.0.join("kubeconfig")).await.unwrap();
    let sa = client_from_kubeconfig(&kc).await.unwrap();

    // What the RBAC does not give is refused (so the grants below are really tested).
    let r = raw(&sa, Method::GET, "/api/v1/namespaces/kube-system/secrets", "", None).await.unwrap();
    assert_eq!(r.status, 403, "{}", r.body);
    let r = raw(&sa, Method::POST, "/api/v1/namespaces/shop/services", "application/json", Some(&lb("shop", "by-agent"))).await.unwrap();
    assert_eq!(r.status, 403, "{}", r.body);
    let who = raw(
        &sa,
        Method::POST,
        "/apis/authentication.k8s.io/v1/selfsubjectreviews",
        "application/json",
        Some(&json!({"apiVersion": "authentication.k8s.io/v1", "kind": "SelfSubjectReview"})),
    )
    .await
    .unwrap();
    assert_eq!(who.body["status"]["userInfo"]["username"], "system:serviceaccount:vip-system:vip-agent", "{}", who.body);

    b.insert("vippools.vip.dev", pool("rbac", &["198.18.9.10-198.18.9.11"])).unwrap();
    b.insert("services", lb("shop", "web")).unwrap();
    let leading = leader::spawn(
        sa.clone(),
        LeaderConfig { lease_duration: Duration::from_secs(2), retry_period: Duration::from_millis(200), ..LeaderConfig::new("vip-system", "node-1") },
    );
    let task =
        tokio::spawn(controller::run(sa.clone(), "node-1".into(), leading.clone(), Duration::from_secs(1), controller::AgentView::fixed(BTreeMap::new()).1));
    eventually_within(Duration::from_secs(15), "leading", || *leading.borrow()).await;
    eventually_within(Duration::from_secs(15), "web allocated", || ip_of(&b, "shop", "web").as_deref() == Some("198.18.9.10")).await;
    eventually_within(Duration::from_secs(15), "pool Ready with counts", || {
        b.get("vippools.vip.dev", None, "rbac").is_some_and(|p| {
            p["status"]["allocated"] == 1
                && p["status"]["conditions"].as_array().is_some_and(|cs| cs.iter().any(|c| c["type"] == "Ready" && c["status"] == "True"))
        })
    })
    .await;
    eventually_within(Duration::from_secs(15), "an Allocated Event", || {
        b.list("events.events.k8s.io", None).iter().any(|e| e["reason"] == "Allocated" && e["regarding"]["name"] == "web")
    })
    .await;
    let lease = b.get("leases.coordination.k8s.io", Some("vip-system"), "vip-controller").expect("the Lease");
    assert_eq!(lease["spec"]["holderIdentity"], "node-1");
    task.abort();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn controller_rides_out_an_api_server_restart() {
    let Some(mut b) = Backend::real().await else {
        return;
    };
    let Backend::Real { server, .. } = &b else { unreachable!() };
    let server = *server;
    b.insert("vippools.vip.dev", pool("outage", &["198.18.9.20-198.18.9.29"])).unwrap();
    b.insert("services", lb("shop", "before")).unwrap();
    let client = b.client().await;
    let (_lead, task) = run_controller(client);
    eventually_within(Duration::from_secs(15), "allocated before the outage", || ip_of(&b, "shop", "before").is_some()).await;

    server.kill();
    tokio::time::sleep(Duration::from_secs(2)).await;
    let took = tokio::task::block_in_place(|| server.restart()).expect("restarted");
    eprintln!("kube-apiserver restarted, ready again after {:.2} s", took.as_secs_f64());
    // A new admin client for the test's own requests (the old connections are gone).
    b.reconnect().await;
    let b2 = b;
    b2.insert("services", lb("shop", "after")).unwrap();
    eventually_within(Duration::from_secs(60), "allocated after the restart", || ip_of(&b2, "shop", "after").is_some()).await;
    assert_ne!(ip_of(&b2, "shop", "after"), ip_of(&b2, "shop", "before"));
    task.abort();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agents_create_one_heartbeat_key_secret_and_read_no_other() {
    use vip_agent::k8s::heartbeat_key;
    let Some(b) = Backend::real().await else {
        return;
    };
    let Backend::Real { server, client: admin, .. } = &b else { unreachable!() };
    let tmp = TempDir::new("vip-sa-").unwrap();
    let kc = server.service_account_kubeconfig(admin, "vip-system", "vip-agent", &tmp.0.join("kubeconfig")).await.unwrap();
    let sa = client_from_kubeconfig(&kc).await.unwrap();
    let secret = "/api/v1/namespaces/vip-system/secrets/vip-heartbeat";
    let r = raw(admin, Method::DELETE, secret, "", None).await.unwrap();
    assert!(r.status == 200 || r.status == 404, "{}", r.body);
    let other = json!({ "apiVersion": "v1", "kind": "Secret", "metadata": { "name": "not-vips", "namespace": "vip-system" }, "stringData": { "x": "y" } });
    let r = raw(admin, Method::POST, "/api/v1/namespaces/vip-system/secrets", "application/json", Some(&other)).await.unwrap();
    assert!(r.status == 201 || r.status == 409, "{}", r.body);

    // Three agents start at once and find no Secret: one creates it, all read its key.
    let starts = (0..3).map(|_| {
        let sa = sa.clone();
        tokio::spawn(async move { heartbeat_key::ensure(&sa, "vip-system", "vip-heartbeat").await })
    });
    let keys: Vec<String> = futures_util::future::join_all(starts).await.into_iter().map(|r| r.unwrap().unwrap()).collect();
    assert!(keys.iter().all(|k| *k == keys[0]), "agents disagree on the key: {keys:?}");
    vip_agent::ha::auth::Keys::from_text(&keys[0]).expect("a usable key");
    let created = raw(admin, Method::GET, secret, "", None).await.unwrap().ok().unwrap();
    assert_eq!(created["metadata"]["labels"]["app.kubernetes.io/name"], "vip");

    // The Role gives that Secret alone.
    for (method, path) in [
        (Method::GET, "/api/v1/namespaces/vip-system/secrets/not-vips"),
        (Method::GET, "/api/v1/namespaces/vip-system/secrets"),
        (Method::DELETE, secret),
        (Method::GET, "/api/v1/namespaces/default/secrets/vip-heartbeat"),
    ] {
        let r = raw(&sa, method.clone(), path, "", None).await.unwrap();
        assert_eq!(r.status, 403, "{method} {path}: {}", r.body);
    }

    // A rotation (a second line, then first) reaches a watching agent.
    let mut rx = heartbeat_key::watch_keys(sa.clone(), "vip-system".into(), "vip-heartbeat".into(), keys[0].clone());
    let rotated = format!("{}\n{}", heartbeat_key::new_key_line().unwrap(), keys[0]);
    let patch = json!({ "stringData": { "key": rotated } });
    raw(admin, Method::PATCH, secret, "application/merge-patch+json", Some(&patch)).await.unwrap().ok().unwrap();
    tokio::time::timeout(Duration::from_secs(20), async {
        while *rx.borrow_and_update() != rotated {
            rx.changed().await.unwrap();
        }
    })
    .await
    .expect("the watching agent did not see the rotation within 20 s");
    raw(admin, Method::DELETE, "/api/v1/namespaces/vip-system/secrets/not-vips", "", None).await.unwrap();
}
