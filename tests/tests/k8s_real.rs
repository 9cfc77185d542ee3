//! Against a real kube-apiserver and etcd (`vip_tests::kubeapi`, binaries from
//! `$KUBEBUILDER_ASSETS`; built `#[ignore]`d without them, see tests/build.rs): one server
//! for this binary, tests serialised on it.
//!
//! - what `kubectl apply -k deploy/` applies, and deploy/examples/, apply (server-side
//!   apply, dry run first) without a rejection or a warning;
//! - the controller rides out an API server outage (SIGKILL, restart on the same etcd).
//!
//! What RBAC grants and refuses runs against both servers, in k8s_rbac.rs.
use std::{path::PathBuf, time::Duration};

use serde_json::json;
use vip_tests::{
    kubeapi::{apply, deploy_dir, kustomize, manifests, Backend},
    kubefix::{eventually_within, ingress_ip, lb_json, pool_json, run_controller},
};

fn yaml_files(dir: &std::path::Path) -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> =
        std::fs::read_dir(dir).unwrap().map(|e| e.unwrap().path()).filter(|p| p.extension().is_some_and(|e| e == "yaml" || e == "yml")).collect();
    v.sort();
    v
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[cfg_attr(not(real_apiserver), ignore = "needs KUBEBUILDER_ASSETS (kube-apiserver, etcd; docs/development/tests.md)")]
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
#[cfg_attr(not(real_apiserver), ignore = "needs KUBEBUILDER_ASSETS (kube-apiserver, etcd; docs/development/tests.md)")]
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[cfg_attr(not(real_apiserver), ignore = "needs KUBEBUILDER_ASSETS (kube-apiserver, etcd; docs/development/tests.md)")]
async fn controller_rides_out_an_api_server_restart() {
    let Some(mut b) = Backend::real().await else {
        return;
    };
    let Backend::Real { server, .. } = &b else { unreachable!() };
    let server = *server;
    b.insert("vippools.vip.dev", pool_json("outage", &["198.18.9.20-198.18.9.29"])).unwrap();
    b.insert("services", lb_json("shop", "before")).unwrap();
    let client = b.client().await;
    let (_lead, task) = run_controller(client);
    eventually_within(Duration::from_secs(15), "allocated before the outage", || ingress_ip(&b, "shop", "before").is_some()).await;

    server.kill();
    tokio::time::sleep(Duration::from_secs(2)).await;
    let took = tokio::task::block_in_place(|| server.restart()).expect("restarted");
    eprintln!("kube-apiserver restarted, ready again after {:.2} s", took.as_secs_f64());
    // A new admin client for the test's own requests (the old connections are gone).
    b.reconnect().await;
    let b2 = b;
    b2.insert("services", lb_json("shop", "after")).unwrap();
    eventually_within(Duration::from_secs(60), "allocated after the restart", || ingress_ip(&b2, "shop", "after").is_some()).await;
    assert_ne!(ingress_ip(&b2, "shop", "after"), ingress_ip(&b2, "shop", "before"));
    task.abort();
}
