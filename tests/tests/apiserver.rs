//! The API server stand-in (`vip_tests::apiserver`) driven by the real kube client,
//! as the agent will use it: CRUD, 409 on stale writes, status subresources,
//! watch/reflector with bookmarks and the re-list after 410 Gone, a Lease race.

use futures_util::StreamExt;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{ConfigMap, Node, Service};
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams, WatchEvent, WatchParams};
use kube::runtime::{reflector, watcher, WatchStreamExt};
use kube::Client;
use serde_json::json;
use std::time::Duration;
use vip_tests::apiserver::{ApiServer, ResourceSpec, Verb};

async fn server() -> ApiServer {
    ApiServer::builder()
        .resources(ResourceSpec::VIP)
        .resource(ResourceSpec::CONFIG_MAPS)
        .bookmark_interval(Duration::from_millis(100))
        .start()
        .await
        .expect("start the stand-in")
}

/// A plain `kube::Config::new` client: kube's rustls connector also speaks plain HTTP.
fn client(srv: &ApiServer) -> Client {
    Client::try_from(kube::Config::new(srv.url().parse().expect("url"))).expect("client")
}

/// Waits (at most 5 s) until `cond` holds.
async fn eventually(what: &str, cond: impl Fn() -> bool) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    while !cond() {
        assert!(tokio::time::Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

fn api_code(r: Result<impl std::fmt::Debug, kube::Error>) -> u16 {
    match r {
        Err(kube::Error::Api(s)) => s.code,
        other => panic!("expected an API error, got {other:?}"),
    }
}

fn config_map(name: &str, app: &str, value: &str) -> ConfigMap {
    serde_json::from_value(json!({
        "metadata": { "name": name, "labels": { "app": app } },
        "data": { "k": value },
    }))
    .expect("ConfigMap")
}

fn service(name: &str, port: u16) -> Service {
    serde_json::from_value(json!({
        "metadata": { "name": name },
        "spec": { "type": "LoadBalancer", "ports": [{ "port": port }] },
    }))
    .expect("Service")
}

fn rv<K: kube::Resource>(k: &K) -> u64 {
    k.meta().resource_version.as_deref().expect("resourceVersion").parse().expect("numeric RV")
}

#[tokio::test]
async fn apiserver_crud_with_kube_client() {
    let srv = server().await;
    let cms: Api<ConfigMap> = Api::namespaced(client(&srv), "ns1");
    let pp = PostParams::default();

    let a = cms.create(&pp, &config_map("a", "web", "1")).await.unwrap();
    let m = &a.metadata;
    assert!(m.uid.is_some() && m.creation_timestamp.is_some(), "{m:?}");
    assert_eq!((m.generation, m.namespace.as_deref()), (Some(1), Some("ns1")));
    assert_eq!(api_code(cms.create(&pp, &config_map("a", "web", "1")).await), 409, "AlreadyExists");
    cms.create(&pp, &config_map("b", "db", "1")).await.unwrap();
    Api::<ConfigMap>::namespaced(client(&srv), "ns2").create(&pp, &config_map("a", "web", "1")).await.unwrap();

    let got = cms.get("a").await.unwrap();
    assert_eq!(got.metadata.uid, a.metadata.uid);
    assert_eq!(api_code(cms.get("nope").await), 404);

    let names = |l: kube::core::ObjectList<ConfigMap>| l.items.into_iter().map(|c| c.metadata.name.unwrap()).collect::<Vec<_>>();
    let all = cms.list(&ListParams::default()).await.unwrap();
    assert!(all.metadata.resource_version.as_deref().is_some_and(|s| !s.is_empty()));
    assert_eq!(names(all), ["a", "b"], "only ns1");
    assert_eq!(names(cms.list(&ListParams::default().labels("app=db")).await.unwrap()), ["b"]);
    assert_eq!(names(cms.list(&ListParams::default().fields("metadata.name=a")).await.unwrap()), ["a"]);
    let every_ns: Api<ConfigMap> = Api::all(client(&srv));
    assert_eq!(every_ns.list(&ListParams::default().labels("app in (web)")).await.unwrap().items.len(), 2);

    let mut changed = got.clone();
    changed.data = Some([("k".to_string(), "2".to_string())].into());
    let replaced = cms.replace("a", &pp, &changed).await.unwrap();
    assert!(rv(&replaced) > rv(&got));
    assert_eq!(replaced.metadata.generation, Some(2), "data changed");
    let again = cms.replace("a", &pp, &replaced).await.unwrap();
    assert_eq!(rv(&again), rv(&replaced), "a write that changes nothing keeps the RV");

    let patched = cms.patch("a", &PatchParams::default(), &Patch::Merge(json!({ "data": { "k": null, "j": "3" } }))).await.unwrap();
    assert_eq!(patched.data, Some([("j".to_string(), "3".to_string())].into()));

    cms.delete("a", &DeleteParams::default()).await.unwrap();
    assert_eq!(api_code(cms.get("a").await), 404);
    assert_eq!(api_code(cms.delete("a", &DeleteParams::default()).await), 404);
    assert_eq!(srv.list("configmaps", None).len(), 2, "b in ns1, a in ns2");
    assert_eq!(srv.requests(Verb::Create), 4);
}

#[tokio::test]
async fn apiserver_stale_writes_conflict() {
    let srv = server().await;
    let svcs: Api<Service> = Api::namespaced(client(&srv), "default");
    let pp = PostParams::default();
    let old = svcs.create(&pp, &service("s", 80)).await.unwrap();
    let newer = svcs.replace("s", &pp, &service_with_port(&old, 81)).await.unwrap();

    assert_eq!(api_code(svcs.replace("s", &pp, &service_with_port(&old, 82)).await), 409, "stale replace");
    let mut status = old.clone();
    status.status = Some(serde_json::from_value(json!({ "loadBalancer": { "ingress": [{ "ip": "198.18.1.10" }] } })).unwrap());
    match svcs.replace_status("s", &pp, &status).await {
        Err(kube::Error::Api(s)) => assert_eq!((s.code, s.reason.as_str()), (409, "Conflict")),
        other => panic!("stale status update: {other:?}"),
    }
    let stale_patch = Patch::Merge(json!({ "metadata": { "resourceVersion": rv(&old).to_string() }, "spec": { "ports": [{ "port": 83 }] } }));
    assert_eq!(api_code(svcs.patch("s", &PatchParams::default(), &stale_patch).await), 409, "stale merge patch");
    let dp = DeleteParams { preconditions: Some(kube::api::Preconditions { resource_version: Some(rv(&old).to_string()), uid: None }), ..Default::default() };
    assert_eq!(api_code(svcs.delete("s", &dp).await), 409, "stale delete precondition");

    // Nothing above changed the object.
    assert_eq!(rv(&svcs.get("s").await.unwrap()), rv(&newer));
}

fn service_with_port(s: &Service, port: u16) -> Service {
    let mut s = s.clone();
    s.spec.as_mut().unwrap().ports.as_mut().unwrap()[0].port = port.into();
    s
}

#[tokio::test]
async fn apiserver_status_subresource_is_separate_from_spec() {
    let srv = server().await;
    let svcs: Api<Service> = Api::namespaced(client(&srv), "default");
    let pp = PostParams::default();
    let mut with_status = service("s", 80);
    with_status.status = Some(serde_json::from_value(json!({ "loadBalancer": { "ingress": [{ "ip": "198.18.0.1" }] } })).unwrap());
    let created = svcs.create(&pp, &with_status).await.unwrap();
    assert_eq!(created.status, None, "create ignores status");

    // A status write carrying a spec change changes only status, and not generation.
    let mut body = service_with_port(&created, 9999);
    body.status = with_status.status.clone();
    let after_status = svcs.replace_status("s", &pp, &body).await.unwrap();
    assert_eq!(after_status.spec.as_ref().unwrap().ports.as_ref().unwrap()[0].port, 80);
    assert_eq!(after_status.status, with_status.status);
    assert_eq!(after_status.metadata.generation, Some(1));

    // A main-resource write carrying a status change changes only spec, and bumps generation.
    let mut body = service_with_port(&after_status, 81);
    body.status = None;
    let after_spec = svcs.replace("s", &pp, &body).await.unwrap();
    assert_eq!(after_spec.status, with_status.status, "status kept");
    assert_eq!(after_spec.metadata.generation, Some(2));

    let patch = Patch::Merge(json!({ "spec": { "type": "ClusterIP" }, "status": { "loadBalancer": {} } }));
    let patched = svcs.patch_status("s", &PatchParams::default(), &patch).await.unwrap();
    assert_eq!(patched.spec.as_ref().unwrap().type_.as_deref(), Some("LoadBalancer"));
    assert_eq!(patched.status.unwrap().load_balancer.unwrap().ingress, with_status.status.unwrap().load_balancer.unwrap().ingress, "merge keeps ingress");
    assert_eq!(patched.metadata.generation, Some(2));

    let cleared = svcs.patch_status("s", &PatchParams::default(), &Patch::Merge(json!({ "status": null }))).await.unwrap();
    assert_eq!(cleared.status, None);
    assert_eq!(srv.get("services", Some("default"), "s").unwrap()["spec"]["ports"][0]["port"], 81);
}

#[tokio::test]
async fn apiserver_reflector_sees_adds_modifies_deletes() {
    let srv = server().await;
    let c = client(&srv);
    let cms: Api<ConfigMap> = Api::namespaced(c.clone(), "ns");
    let pp = PostParams::default();
    cms.create(&pp, &config_map("before", "web", "0")).await.unwrap();
    cms.create(&pp, &config_map("other-app", "db", "0")).await.unwrap();

    let (store, writer) = reflector::store();
    let cfg = watcher::Config::default().labels("app=web");
    let run = tokio::spawn(reflector(writer, watcher(cms.clone(), cfg)).applied_objects().for_each(|_| async {}));
    store.wait_until_ready().await.unwrap();
    let values = || {
        let mut v: Vec<_> = store.state().iter().map(|c| (c.metadata.name.clone().unwrap(), c.data.clone().unwrap()["k"].clone())).collect();
        v.sort();
        v
    };
    let pairs = |p: &[(&str, &str)]| p.iter().map(|(a, b)| (a.to_string(), b.to_string())).collect::<Vec<_>>();
    assert_eq!(values(), pairs(&[("before", "0")]), "the selector leaves other-app out");

    cms.create(&pp, &config_map("added", "web", "1")).await.unwrap();
    cms.patch("before", &PatchParams::default(), &Patch::Merge(json!({ "data": { "k": "2" } }))).await.unwrap();
    // Moving into and out of the selection arrives as ADDED and DELETED.
    cms.patch("other-app", &PatchParams::default(), &Patch::Merge(json!({ "metadata": { "labels": { "app": "web" } } }))).await.unwrap();
    eventually("adds and modifies", || values() == pairs(&[("added", "1"), ("before", "2"), ("other-app", "0")])).await;
    cms.delete("added", &DeleteParams::default()).await.unwrap();
    cms.patch("other-app", &PatchParams::default(), &Patch::Merge(json!({ "metadata": { "labels": { "app": "db" } } }))).await.unwrap();
    eventually("deletes", || values() == pairs(&[("before", "2")])).await;
    assert_eq!(srv.requests(Verb::List), 1, "no re-list without a 410");
    run.abort();
}

#[tokio::test]
async fn apiserver_bookmarks_and_replay_from_resource_version() {
    let srv = server().await;
    let cms: Api<ConfigMap> = Api::namespaced(client(&srv), "ns");
    let pp = PostParams::default();
    let first = cms.create(&pp, &config_map("first", "web", "0")).await.unwrap();
    cms.create(&pp, &config_map("second", "web", "0")).await.unwrap();

    // From the first object's RV: the second is replayed, then live events and bookmarks.
    let wp = WatchParams::default().timeout(10); // kube asks for bookmarks by default
    let mut events = cms.watch(&wp, &rv(&first).to_string()).await.unwrap().boxed();
    let mut next = async || tokio::time::timeout(Duration::from_secs(5), events.next()).await.expect("an event in time").expect("stream open").unwrap();
    match next().await {
        WatchEvent::Added(c) => assert_eq!(c.metadata.name.as_deref(), Some("second")),
        e => panic!("expected the replayed ADDED, got {e:?}"),
    }
    match next().await {
        WatchEvent::Bookmark(b) => {
            assert_eq!(b.metadata.resource_version.parse::<u64>().unwrap(), srv.resource_version());
            assert_eq!(b.types.kind, "ConfigMap");
        }
        e => panic!("expected a bookmark, got {e:?}"),
    }
    cms.delete("first", &DeleteParams::default()).await.unwrap();
    loop {
        match next().await {
            WatchEvent::Bookmark(_) => continue,
            WatchEvent::Deleted(c) => break assert_eq!(rv(&c), srv.resource_version(), "DELETED carries the deletion's RV"),
            e => panic!("expected DELETED, got {e:?}"),
        }
    }
}

#[tokio::test]
async fn apiserver_watch_from_compacted_rv_gets_410_and_watcher_relists() {
    let srv = server().await;
    let cms: Api<ConfigMap> = Api::namespaced(client(&srv), "ns");
    let pp = PostParams::default();
    let old = cms.create(&pp, &config_map("keep", "web", "0")).await.unwrap();
    cms.create(&pp, &config_map("gone", "web", "0")).await.unwrap();

    let (store, writer) = reflector::store();
    let run = tokio::spawn(reflector(writer, watcher(cms.clone(), watcher::Config::default())).applied_objects().for_each(|_| async {}));
    store.wait_until_ready().await.unwrap();
    eventually("the watch to open", || srv.open_watches() == 1).await;
    let lists = srv.requests(Verb::List);

    srv.compact();
    // Changes the watcher can only learn from a re-list: they happen while it is told 410.
    srv.remove("configmaps", Some("ns"), "gone").unwrap();
    srv.insert("configmaps", json!({ "metadata": { "name": "new", "namespace": "ns" }, "data": { "k": "1" } })).unwrap();
    let names = || {
        let mut v: Vec<_> = store.state().iter().map(|c| c.metadata.name.clone().unwrap()).collect();
        v.sort();
        v
    };
    eventually("the store to follow the re-list", || names() == ["keep", "new"]).await;
    assert!(srv.requests(Verb::List) > lists, "a re-list happened");

    // The raw response a client gets for an RV older than the history.
    let mut raw = cms.watch(&WatchParams::default(), &rv(&old).to_string()).await.unwrap().boxed();
    match raw.next().await {
        Some(Ok(WatchEvent::Error(s))) => {
            assert_eq!((s.code, s.reason.as_str()), (410, "Expired"));
            assert!(s.message.starts_with("too old resource version"), "{}", s.message);
        }
        e => panic!("expected a 410 ERROR event, got {e:?}"),
    }
    assert!(raw.next().await.is_none(), "the stream ends after the 410");
    run.abort();
}

#[tokio::test]
async fn apiserver_lease_race_has_one_winner() {
    let srv = server().await;
    let lease: Lease = serde_json::from_value(json!({
        "metadata": { "name": "vip-leader", "namespace": "vip-system" },
        "spec": { "holderIdentity": "nobody", "leaseDurationSeconds": 10 },
    }))
    .unwrap();
    let (a, b): (Api<Lease>, Api<Lease>) = (Api::namespaced(client(&srv), "vip-system"), Api::namespaced(client(&srv), "vip-system"));
    a.create(&PostParams::default(), &lease).await.unwrap();

    let take = async |api: &Api<Lease>, who: &str| {
        let mut l = api.get("vip-leader").await.unwrap();
        l.spec.as_mut().unwrap().holder_identity = Some(who.to_string());
        (l, who.to_string())
    };
    // Both read the same version before either writes.
    let ((la, wa), (lb, wb)) = tokio::join!(take(&a, "node-a"), take(&b, "node-b"));
    assert_eq!(rv(&la), rv(&lb));
    let pp = PostParams::default();
    let (ra, rb) = tokio::join!(a.replace("vip-leader", &pp, &la), b.replace("vip-leader", &pp, &lb));
    let winner = match (ra, rb) {
        (Ok(_), Err(kube::Error::Api(s))) if s.code == 409 => wa,
        (Err(kube::Error::Api(s)), Ok(_)) if s.code == 409 => wb,
        other => panic!("expected exactly one winner and one 409: {other:?}"),
    };
    let held = a.get("vip-leader").await.unwrap();
    assert_eq!(held.spec.unwrap().holder_identity, Some(winner));
}

#[tokio::test]
async fn apiserver_discovery_and_cluster_scoped_crd() {
    let srv = server().await;
    let c = client(&srv);
    assert_eq!(c.apiserver_version().await.unwrap().major, "1");
    let discovery = kube::Discovery::new(c.clone()).run().await.unwrap();
    let (ar, caps) = discovery.groups().flat_map(|g| g.recommended_resources()).find(|(ar, _)| ar.plural == "vippools").expect("vippools discovered");
    assert_eq!((ar.group.as_str(), ar.version.as_str(), ar.kind.as_str()), ("vip.dev", "v1alpha1", "VipPool"));
    assert_eq!(caps.scope, kube::discovery::Scope::Cluster);
    assert!(caps.subresources.iter().any(|(s, _)| s.plural == "vippools/status" || s.plural == "status"), "{:?}", caps.subresources);

    let pools: Api<kube::api::DynamicObject> = Api::all_with(c, &ar);
    let pool = serde_json::from_value(json!({
        "apiVersion": "vip.dev/v1alpha1", "kind": "VipPool",
        "metadata": { "name": "pool-a" }, "spec": { "addresses": ["198.18.1.10/32"] },
    }))
    .unwrap();
    pools.create(&PostParams::default(), &pool).await.unwrap();
    pools.patch_status("pool-a", &PatchParams::default(), &Patch::Merge(json!({ "status": { "allocated": 1 } }))).await.unwrap();
    let stored = srv.get("vippools.vip.dev", None, "pool-a").unwrap();
    assert_eq!(stored["status"]["allocated"], 1);
    assert_eq!(stored["metadata"]["generation"], 1);
    assert!(stored["metadata"].get("namespace").is_none(), "cluster-scoped");
}

#[tokio::test]
async fn apiserver_taints_nodes_created_through_the_api_unless_turned_off() {
    let node = json!({ "apiVersion": "v1", "kind": "Node", "metadata": { "name": "n1" } });
    for on in [true, false] {
        let srv = ApiServer::builder().resources(ResourceSpec::VIP).taint_new_nodes(on).start().await.unwrap();
        let nodes: Api<Node> = Api::all(client(&srv));
        let created = nodes.create(&PostParams::default(), &serde_json::from_value(node.clone()).unwrap()).await.unwrap();
        let keys: Vec<String> = created.spec.and_then(|s| s.taints).unwrap_or_default().into_iter().map(|t| format!("{}:{}", t.key, t.effect)).collect();
        let want: &[&str] = if on { &["node.kubernetes.io/not-ready:NoSchedule"] } else { &[] };
        assert_eq!(keys, want, "taint_new_nodes({on})");
        // A fixture is a Node already registered and lifted: no admission.
        let fixture = srv.insert("nodes", json!({ "metadata": { "name": "n2" } })).unwrap();
        assert_eq!(fixture["spec"].get("taints"), None, "{fixture}");
    }
}

#[tokio::test]
async fn apiserver_fixtures_follow_the_registry_rules() {
    let srv = server().await;
    let svc = |name: &str, spec: serde_json::Value| json!({ "metadata": { "name": name, "namespace": "shop" }, "spec": spec });
    let lb = srv.insert("services", svc("lb", json!({ "type": "LoadBalancer", "externalTrafficPolicy": "Local", "ports": [{ "port": 80 }] }))).unwrap();
    let np = lb["spec"]["ports"][0]["nodePort"].as_i64().unwrap();
    let hc = lb["spec"]["healthCheckNodePort"].as_i64().unwrap();
    assert!(vip_tests::apiserver::NODE_PORTS.contains(&np) && vip_tests::apiserver::NODE_PORTS.contains(&hc) && np != hc, "{lb}");
    let err = srv
        .insert(
            "services",
            svc("hc80", json!({ "type": "LoadBalancer", "externalTrafficPolicy": "Local", "healthCheckNodePort": 80, "ports": [{ "port": 80 }] })),
        )
        .unwrap_err();
    assert_eq!((err.code, err.reason), (500, "InternalError"), "{err}");
    let err = srv.insert("services", svc("taken", json!({ "type": "NodePort", "ports": [{ "port": 80, "nodePort": np }] }))).unwrap_err();
    assert_eq!(err.message, format!("Service \"taken\" is invalid: spec.ports[0].nodePort: Invalid value: {np}: provided port is already allocated"));
    let pool = json!({ "apiVersion": "vip.dev/v1alpha1", "kind": "VipPool", "metadata": { "name": "p" }, "spec": { "addresses": [], "announce": "bgp" } });
    let err = srv.insert("vippools.vip.dev", pool).unwrap_err();
    assert_eq!(err.message, "VipPool.vip.dev \"p\" is invalid: spec.announce: Unsupported value: \"bgp\": supported values: \"arp\", \"lo\"");
    // Status is the fixture's to set, and checked like a status write.
    let pool =
        json!({ "apiVersion": "vip.dev/v1alpha1", "kind": "VipPool", "metadata": { "name": "p" }, "spec": { "addresses": [] }, "status": { "total": 3 } });
    let stored = srv.insert("vippools.vip.dev", pool).unwrap();
    assert_eq!(stored["status"], json!({ "total": 3, "allocated": 0, "free": 0, "conditions": [] }));
}

/// Over HTTPS (as the agents in the lab reach it, in-cluster): a client that
/// trusts the serving certificate's CA and names an address the certificate
/// holds gets through, watches included; one with another CA, or naming an
/// address the certificate lacks, is refused at the handshake, as by the real
/// server.
#[tokio::test]
async fn apiserver_over_tls_checks_the_ca_and_the_name() {
    use vip_tests::kubeapi::{client_from_kubeconfig, kubeconfig_text, Ca};
    let ca = Ca::new().unwrap();
    let (cert, key) = ca.server("kube-apiserver", &["127.0.0.1".parse().unwrap()], &["kubernetes.default.svc"]).unwrap();
    let srv = ApiServer::builder().resources(ResourceSpec::VIP).tls(&cert, &key).unwrap().start().await.unwrap();
    assert!(srv.url().starts_with("https://127.0.0.1:"), "{}", srv.url());
    let trusted = client_from_kubeconfig(&kubeconfig_text(&srv.url(), Some(&ca.pem()), json!({}), "default")).await.unwrap();
    let svcs: Api<Service> = Api::namespaced(trusted, "shop");
    svcs.create(&PostParams::default(), &service("web", 80)).await.expect("a create over TLS");
    let mut events = svcs.watch(&WatchParams::default(), "0").await.expect("a watch over TLS").boxed();
    let first = tokio::time::timeout(Duration::from_secs(5), events.next()).await.expect("a watch event").expect("an item").expect("an event");
    assert!(matches!(first, WatchEvent::Added(_)), "{first:?}");

    let other = Ca::new().unwrap();
    let untrusted = client_from_kubeconfig(&kubeconfig_text(&srv.url(), Some(&other.pem()), json!({}), "default")).await.unwrap();
    let refused = Api::<Service>::namespaced(untrusted, "shop").list(&ListParams::default()).await;
    assert!(format!("{refused:?}").contains("InvalidCertificate"), "a client trusting another CA got {refused:?}");
    // `localhost` is the same server, but not a name its certificate holds.
    let port = srv.addr().port();
    let misnamed = client_from_kubeconfig(&kubeconfig_text(&format!("https://localhost:{port}"), Some(&ca.pem()), json!({}), "default")).await.unwrap();
    let refused = Api::<Service>::namespaced(misnamed, "shop").list(&ListParams::default()).await;
    assert!(format!("{refused:?}").contains("NotValidForName"), "a client naming an address outside the certificate got {refused:?}");
}
