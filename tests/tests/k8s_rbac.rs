//! What deploy/10-rbac.yaml lets the agent do, against both API servers (the
//! stand-in holds token users to the same RBAC, tests/src/apiserver/rbac.rs): the
//! controller and leader election, acting as the ServiceAccount, allocate, record
//! Events and hold the Lease; what the RBAC does not grant is refused with the real
//! server's 403; three agents starting at once create one heartbeat key Secret and
//! read no other; an unknown token is a 401.
//!
//! The 403 and 401 codes are what kube-apiserver v1.36.2 answered to these requests;
//! the 403 messages are worded as its source (`responsewriters.forbiddenMessage`)
//! words them, and the `real` halves check that wording where the server is supplied.
use std::{collections::BTreeMap, time::Duration};

use http::Method;
use serde_json::json;
use vip_agent::k8s::{
    controller,
    leader::{self, LeaderConfig},
};
use vip_tests::{
    kubeapi::{raw, Backend, Reply},
    kubefix::{eventually_within, ingress_ip, lb_json, pool_json},
};

vip_tests::both_api_servers!(controller_and_election_work_with_exactly_the_deploy_rbac);
vip_tests::both_api_servers!(agents_create_one_heartbeat_key_secret_and_read_no_other);

const AGENT: &str = "system:serviceaccount:vip-system:vip-agent";

#[track_caller]
fn forbidden(r: &Reply, message: &str) {
    assert_eq!((r.status, r.body["reason"].as_str(), r.body["message"].as_str()), (403, Some("Forbidden"), Some(message)), "{}", r.body);
}

async fn controller_and_election_work_with_exactly_the_deploy_rbac(b: Backend) {
    let sa = b.service_account_client("vip-system", "vip-agent").await;

    // What the RBAC does not give is refused (so the grants below are really tested).
    let r = raw(&sa, Method::GET, "/api/v1/namespaces/kube-system/secrets", "", None).await.unwrap();
    forbidden(&r, &format!("secrets is forbidden: User \"{AGENT}\" cannot list resource \"secrets\" in API group \"\" in the namespace \"kube-system\""));
    let r = raw(&sa, Method::POST, "/api/v1/namespaces/shop/services", "application/json", Some(&lb_json("shop", "by-agent"))).await.unwrap();
    forbidden(&r, &format!("services is forbidden: User \"{AGENT}\" cannot create resource \"services\" in API group \"\" in the namespace \"shop\""));
    let r = raw(&sa, Method::PATCH, "/apis/vip.dev/v1alpha1/vippools/rbac", "application/merge-patch+json", Some(&json!({ "spec": { "autoAssign": false } })))
        .await
        .unwrap();
    forbidden(
        &r,
        &format!("vippools.vip.dev \"rbac\" is forbidden: User \"{AGENT}\" cannot patch resource \"vippools\" in API group \"vip.dev\" at the cluster scope"),
    );
    let who = raw(
        &sa,
        Method::POST,
        "/apis/authentication.k8s.io/v1/selfsubjectreviews",
        "application/json",
        Some(&json!({"apiVersion": "authentication.k8s.io/v1", "kind": "SelfSubjectReview"})),
    )
    .await
    .unwrap();
    assert_eq!(who.body["status"]["userInfo"]["username"], AGENT, "{}", who.body);

    b.insert("vippools.vip.dev", pool_json("rbac", &["198.18.9.10-198.18.9.11"])).unwrap();
    b.insert("services", lb_json("shop", "web")).unwrap();
    let leading = leader::spawn(
        sa.clone(),
        LeaderConfig { lease_duration: Duration::from_secs(2), retry_period: Duration::from_millis(200), ..LeaderConfig::new("vip-system", "node-1") },
    );
    let task =
        tokio::spawn(controller::run(sa.clone(), "node-1".into(), leading.clone(), Duration::from_secs(1), controller::AgentView::fixed(BTreeMap::new()).1));
    eventually_within(Duration::from_secs(15), "leading", || *leading.borrow()).await;
    eventually_within(Duration::from_secs(15), "web allocated", || ingress_ip(&b, "shop", "web").as_deref() == Some("198.18.9.10")).await;
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

async fn agents_create_one_heartbeat_key_secret_and_read_no_other(b: Backend) {
    use vip_agent::k8s::heartbeat_key;
    let sa = b.service_account_client("vip-system", "vip-agent").await;
    let admin = &b.client().await;
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
        assert_eq!((r.status, r.body["reason"].as_str()), (403, Some("Forbidden")), "{method} {path}: {}", r.body);
    }

    let r = raw(&sa, Method::GET, "/api/v1/namespaces/vip-system/secrets/not-vips", "", None).await.unwrap();
    forbidden(
        &r,
        &format!("secrets \"not-vips\" is forbidden: User \"{AGENT}\" cannot get resource \"secrets\" in API group \"\" in the namespace \"vip-system\""),
    );
    // An unknown token is no one.
    let nobody = b.client_with_token("not-a-token").await;
    let r = raw(&nobody, Method::GET, secret, "", None).await.unwrap();
    assert_eq!((r.status, r.body["reason"].as_str(), r.body["message"].as_str()), (401, Some("Unauthorized"), Some("Unauthorized")), "{}", r.body);

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
