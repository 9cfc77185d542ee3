//! An in-process stand-in for the Kubernetes API server (docs/development/tests.md,
//! "Kubernetes: the real API server and the stand-in"): the agent's real kube-rs client code runs against it in CI.
//!
//! Objects are `serde_json::Value`s of any registered resource (group, version,
//! plural; namespaced or cluster-scoped), kept in memory with one global
//! resourceVersion counter, as etcd has.
//!
//! Covered, as the real server does it:
//! - list (`labelSelector`, `fieldSelector`; one page, no `continue` token), get,
//!   create (uid, resourceVersion, creationTimestamp, generation 1; `generateName`;
//!   409 AlreadyExists), replace (PUT), delete (with `preconditions`), JSON merge patch;
//! - server-side apply on `/status` subresources, with field ownership per
//!   top-level field of `.status` (exact for a status of scalars and atomic lists,
//!   as VipStatus's): `fieldManager` required, a field another manager owns with a
//!   different value is a 409 conflict unless `force=true` (which takes it over),
//!   fields the manager applied before and omits now are removed unless another
//!   manager owns them too; a merge patch or PUT of the status hands the fields it
//!   changes to an update manager;
//! - 409 Conflict when a PUT body, a merge patch or delete preconditions carry a stale
//!   `metadata.resourceVersion` (or another `uid`); a write that changes nothing
//!   keeps the RV and emits no event; `generation` moves on changes outside
//!   metadata and status only;
//! - status subresources: `/status` writes change only `.status`; main-resource
//!   create/PUT/PATCH leave `.status` alone for resources registered with `status`;
//! - watch: newline-delimited events, replay after `resourceVersion` from a bounded
//!   history, 410 Expired as an ERROR event for RVs older than it, bookmarks
//!   (`allowWatchBookmarks`, configurable interval), `timeoutSeconds`, selector
//!   watches turning MODIFIED into ADDED/DELETED as objects enter or leave the
//!   selection, `sendInitialEvents` (streaming lists);
//! - errors as `Status` bodies; minimal discovery (`/api`, `/apis`, `/version`,
//!   resource lists);
//! - what the server does to the objects vip uses before storing them (each checked
//!   against a real kube-apiserver v1.36 in tests/tests/k8s_strict.rs): Services'
//!   defaults, clusterIP and nodePort allocation, validation and update rules
//!   (services.rs); custom resources pruned, defaulted and validated against their
//!   CRD's structural schema from deploy/crd.yaml, with `Warning` headers for
//!   pruned fields (crd.rs); the admission plugin that taints new Nodes not-ready
//!   (nodes.rs, [`ApiServerBuilder::taint_new_nodes`]). [`ApiServer::insert`] goes
//!   through the same registry rules as a client's write but not through admission.
//! - authentication by the stand-in's ServiceAccount tokens and RBAC from
//!   deploy/10-rbac.yaml, 403s worded as the real server's (rbac.rs);
//! - HTTPS with a serving certificate ([`ApiServerBuilder::tls`]), as clients in a
//!   pod reach the real server: by the `kubernetes` Service's address, checked
//!   against the ServiceAccount's `ca.crt`;
//!
//! Not covered: other admission plugins,
//! validation and defaulting of other kinds, finalizers and graceful deletion (a delete removes at
//! once), owner references and garbage collection, strategic merge, JSON patches
//! and server-side apply of whole objects (415), `managedFields`, delete-collection, `resourceVersion` on lists
//! (always the current state), pagination, field selectors are any dotted path
//! (the real server allows only a per-kind set), protobuf, aggregated discovery,
//! namespace lifecycle (Namespace objects can be stored and watched for their
//! labels, but a namespaced object may name any namespace).

mod crd;
mod nodes;
mod rbac;
mod select;
mod services;
mod store;
mod watch;

pub use nodes::NOT_READY;
pub use rbac::{service_account_token, Rbac, User};
pub use services::{Stack, NODE_PORTS};

use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{header, HeaderMap, Method, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use serde_json::{json, Value};
use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use store::{merge_patch, Part, Store};

/// One resource the server serves, as `kubectl api-resources` would list it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ResourceSpec {
    /// "" for the core group.
    pub group: &'static str,
    pub version: &'static str,
    pub plural: &'static str,
    pub kind: &'static str,
    pub namespaced: bool,
    /// Has a `/status` subresource.
    pub status: bool,
}

const fn res(group: &'static str, version: &'static str, plural: &'static str, kind: &'static str, namespaced: bool, status: bool) -> ResourceSpec {
    ResourceSpec { group, version, plural, kind, namespaced, status }
}

impl ResourceSpec {
    pub const SERVICES: Self = res("", "v1", "services", "Service", true, true);
    pub const NODES: Self = res("", "v1", "nodes", "Node", false, true);
    pub const EVENTS: Self = res("", "v1", "events", "Event", true, false);
    pub const EVENTS_V1: Self = res("events.k8s.io", "v1", "events", "Event", true, false);
    pub const ENDPOINT_SLICES: Self = res("discovery.k8s.io", "v1", "endpointslices", "EndpointSlice", true, false);
    pub const LEASES: Self = res("coordination.k8s.io", "v1", "leases", "Lease", true, false);
    pub const VIP_POOLS: Self = res("vip.dev", "v1alpha1", "vippools", "VipPool", false, true);
    pub const VIP_STATUSES: Self = res("vip.dev", "v1alpha1", "vipstatuses", "VipStatus", false, true);
    pub const CONFIG_MAPS: Self = res("", "v1", "configmaps", "ConfigMap", true, false);
    /// Namespaces as objects (their labels feed VipPools' namespaceSelector).
    pub const NAMESPACES: Self = res("", "v1", "namespaces", "Namespace", false, true);
    /// The heartbeat key Secret (`stringData` stored as `data`, as the real server does).
    pub const SECRETS: Self = res("", "v1", "secrets", "Secret", true, false);
    /// What vip's agent reads and writes.
    pub const VIP: [Self; 10] = [
        Self::SERVICES,
        Self::NODES,
        Self::NAMESPACES,
        Self::EVENTS,
        Self::EVENTS_V1,
        Self::ENDPOINT_SLICES,
        Self::LEASES,
        Self::VIP_POOLS,
        Self::VIP_STATUSES,
        Self::SECRETS,
    ];

    pub fn api_version(&self) -> String {
        if self.group.is_empty() {
            self.version.to_owned()
        } else {
            format!("{}/{}", self.group, self.version)
        }
    }

    /// `leases.coordination.k8s.io`, `services`: how the real server names it in messages,
    /// and how the in-process accessors take it.
    pub fn qualified(&self) -> String {
        if self.group.is_empty() {
            self.plural.to_owned()
        } else {
            format!("{}.{}", self.plural, self.group)
        }
    }
}

/// One entry of a 422's `details.causes`: what the real server reports per field.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Cause {
    /// `FieldValueInvalid`, `FieldValueRequired`, ...
    pub reason: &'static str,
    pub message: String,
    /// `spec.ports[0].nodePort` (`<nil>` where the real server names none).
    pub field: String,
}

impl Cause {
    pub(crate) fn invalid(field: &str, message: &str) -> Self {
        Cause { reason: "FieldValueInvalid", message: message.into(), field: field.into() }
    }
}

/// A failed request, sent as a `Status` body.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ApiError {
    pub code: u16,
    pub reason: &'static str,
    pub message: String,
    details: Option<Value>,
}

impl ApiError {
    fn new(code: u16, reason: &'static str, message: String) -> Self {
        ApiError { code, reason, message, details: None }
    }
    fn details(mut self, spec: &ResourceSpec, name: &str) -> Self {
        self.details = Some(json!({ "name": name, "group": spec.group, "kind": spec.plural }));
        self
    }
    fn not_found(spec: &ResourceSpec, name: &str) -> Self {
        Self::new(404, "NotFound", format!("{} \"{name}\" not found", spec.qualified())).details(spec, name)
    }
    fn conflict(spec: &ResourceSpec, name: &str) -> Self {
        let msg = format!(
            "Operation cannot be fulfilled on {} \"{name}\": the object has been modified; please apply your changes to the latest version and try again",
            spec.qualified()
        );
        Self::new(409, "Conflict", msg).details(spec, name)
    }
    fn expired(message: String) -> Self {
        Self::new(410, "Expired", message)
    }
    /// 422 Invalid worded as the real server words it: `Service "web" is invalid:
    /// spec.x: ...`, several causes as `[a, b]`; custom kinds as `VipPool.vip.dev`.
    pub(crate) fn invalid(spec: &ResourceSpec, name: &str, causes: Vec<Cause>) -> Self {
        let kind = if spec.group.is_empty() { spec.kind.to_owned() } else { format!("{}.{}", spec.kind, spec.group) };
        let each: Vec<String> = causes.iter().map(|c| format!("{}: {}", c.field, c.message)).collect();
        let what = if each.len() == 1 { each[0].clone() } else { format!("[{}]", each.join(", ")) };
        let mut e = Self::new(422, "Invalid", format!("{kind} \"{name}\" is invalid: {what}"));
        let causes: Vec<Value> = causes.iter().map(|c| json!({ "reason": c.reason, "message": c.message, "field": c.field })).collect();
        let mut details = json!({ "name": name, "kind": spec.kind, "causes": causes });
        if !spec.group.is_empty() {
            details["group"] = spec.group.into();
        }
        e.details = Some(details);
        e
    }
    pub(crate) fn invalid_service(name: &str, causes: Vec<Cause>) -> Self {
        Self::invalid(&ResourceSpec::SERVICES, name, causes)
    }
    pub fn to_json(&self) -> Value {
        let mut v = json!({
            "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
            "message": self.message, "reason": self.reason, "code": self.code,
        });
        if let Some(d) = &self.details {
            v["details"] = d.clone();
        }
        v
    }
}

impl std::fmt::Display for ApiError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} {}: {}", self.code, self.reason, self.message)
    }
}

impl std::error::Error for ApiError {}

/// Request kinds, as the real server's audit log names them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verb {
    Get,
    List,
    Watch,
    Create,
    Update,
    Patch,
    Delete,
}

pub(crate) struct Shared {
    store: Mutex<Store>,
    bookmark_interval: Duration,
    requests: [AtomicU64; 7],
    /// Every User-Agent requests came with.
    user_agents: Mutex<std::collections::BTreeSet<String>>,
    /// Who may do what (rbac.rs): deploy/10-rbac.yaml's grants.
    rbac: Rbac,
}

pub struct ApiServerBuilder {
    bind: std::net::SocketAddr,
    resources: Vec<ResourceSpec>,
    bookmark_interval: Duration,
    history_limit: usize,
    taint_new_nodes: bool,
    stack: Stack,
    tls: Option<Arc<rustls::ServerConfig>>,
}

impl ApiServerBuilder {
    /// Serves HTTPS with this certificate chain and key (PEM) instead of HTTP.
    pub fn tls(mut self, cert_pem: &str, key_pem: &str) -> anyhow::Result<Self> {
        use rustls::pki_types::{pem::PemObject as _, CertificateDer, PrivateKeyDer};
        let certs = CertificateDer::pem_slice_iter(cert_pem.as_bytes()).collect::<Result<Vec<_>, _>>()?;
        let key = PrivateKeyDer::from_pem_slice(key_pem.as_bytes())?;
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let config =
            rustls::ServerConfig::builder_with_provider(provider).with_safe_default_protocol_versions()?.with_no_client_auth().with_single_cert(certs, key)?;
        self.tls = Some(Arc::new(config));
        Ok(self)
    }

    pub fn resource(mut self, spec: ResourceSpec) -> Self {
        self.resources.push(spec);
        self
    }
    pub fn resources(self, specs: impl IntoIterator<Item = ResourceSpec>) -> Self {
        specs.into_iter().fold(self, Self::resource)
    }
    /// How often an open watch that asked for bookmarks gets one (default 5 s).
    /// Where to listen (default 127.0.0.1:0); a lab namespace's address lets agents
    /// in other namespaces of the lab reach it.
    pub fn bind(mut self, addr: std::net::SocketAddr) -> Self {
        self.bind = addr;
        self
    }

    pub fn bookmark_interval(mut self, every: Duration) -> Self {
        self.bookmark_interval = every;
        self
    }
    /// Whether Nodes created through the API get the `node.kubernetes.io/not-ready:NoSchedule`
    /// taint, as from the real server's TaintNodesByCondition admission plugin (default
    /// on, as there; see nodes.rs). Off is a server run with that plugin disabled.
    pub fn taint_new_nodes(mut self, on: bool) -> Self {
        self.taint_new_nodes = on;
        self
    }
    /// The cluster's service CIDRs: IPv4 only (the default, as the tests' real
    /// server) or IPv4 and IPv6 (services.rs).
    pub fn stack(mut self, stack: Stack) -> Self {
        self.stack = stack;
        self
    }
    /// How many events (of all resources) watches can be resumed over (default 1000).
    pub fn history_limit(mut self, events: usize) -> Self {
        self.history_limit = events.max(1);
        self
    }
    /// Serves on 127.0.0.1 on a free port, on the current tokio runtime.
    pub async fn start(self) -> anyhow::Result<ApiServer> {
        let listener = tokio::net::TcpListener::bind(self.bind).await?;
        let addr = listener.local_addr()?;
        let shared = Arc::new(Shared {
            store: Mutex::new(Store::new(self.resources, self.history_limit, self.taint_new_nodes, self.stack)),
            bookmark_interval: self.bookmark_interval,
            requests: Default::default(),
            user_agents: Default::default(),
            rbac: Rbac::deploy(),
        });
        let (task, shutdown) = serve_on(listener, shared.clone(), self.tls.clone());
        Ok(ApiServer { addr, shared, task, shutdown: Some(shutdown), tls: self.tls })
    }
}

/// Serves `shared` on `listener` (HTTPS with `tls`) until the sender fires (or is dropped).
fn serve_on(
    listener: tokio::net::TcpListener,
    shared: Arc<Shared>,
    tls: Option<Arc<rustls::ServerConfig>>,
) -> (tokio::task::JoinHandle<()>, tokio::sync::oneshot::Sender<()>) {
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let app = axum::Router::new().fallback(handle).with_state(shared);
    let task = match tls {
        None => tokio::spawn(async move {
            let _ = axum::serve(listener, app)
                .with_graceful_shutdown(async move {
                    let _ = rx.await;
                })
                .await;
        }),
        Some(config) => tokio::spawn(serve_tls(listener, app, tokio_rustls::TlsAcceptor::from(config), rx)),
    };
    (task, tx)
}

/// [`serve_on`] over TLS: one task per connection, all aborted when `stop` fires
/// (the watches are ended first, see [`ApiServer::stop`]).
async fn serve_tls(listener: tokio::net::TcpListener, app: axum::Router, acceptor: tokio_rustls::TlsAcceptor, mut stop: tokio::sync::oneshot::Receiver<()>) {
    let mut conns = tokio::task::JoinSet::new();
    loop {
        let (tcp, _) = tokio::select! {
            _ = &mut stop => return,
            accepted = listener.accept() => match accepted {
                Ok(a) => a,
                Err(_) => continue,
            },
        };
        let (acceptor, app) = (acceptor.clone(), app.clone());
        conns.spawn(async move {
            // A client that fails the handshake (a wrong CA, say) is just dropped, as by the real server.
            let Ok(stream) = acceptor.accept(tcp).await else { return };
            let service = hyper_util::service::TowerToHyperService::new(app);
            let _ = hyper::server::conn::http1::Builder::new().serve_connection(hyper_util::rt::TokioIo::new(stream), service).await;
        });
        while conns.try_join_next().is_some() {}
    }
}

/// A running stand-in; stops (ending every watch) when dropped.
pub struct ApiServer {
    addr: SocketAddr,
    shared: Arc<Shared>,
    task: tokio::task::JoinHandle<()>,
    /// Stops `task` gracefully (None while stopped).
    shutdown: Option<tokio::sync::oneshot::Sender<()>>,
    /// Serving HTTPS: its configuration, for restarts.
    tls: Option<Arc<rustls::ServerConfig>>,
}

impl Drop for ApiServer {
    fn drop(&mut self) {
        self.close_watches();
        self.task.abort();
    }
}

/// Writes a kubeconfig at `path` for the stand-in at `url` (plain HTTP, namespace
/// vip-system), with a bearer token ([`service_account_token`]) or no credentials
/// (the admin), for agents run as processes.
pub fn write_kubeconfig(path: &std::path::Path, url: &str, token: Option<&str>) -> anyhow::Result<std::path::PathBuf> {
    let user = token.map_or_else(|| json!({}), |t| json!({ "token": t }));
    crate::agent::write_atomic(path, &crate::kubeapi::kubeconfig_text(url, None, user, "vip-system"))?;
    Ok(path.to_owned())
}

impl ApiServer {
    pub fn builder() -> ApiServerBuilder {
        ApiServerBuilder {
            bind: ([127, 0, 0, 1], 0).into(),
            resources: Vec::new(),
            bookmark_interval: Duration::from_secs(5),
            history_limit: 1000,
            taint_new_nodes: true,
            stack: Stack::V4,
            tls: None,
        }
    }

    /// `http://ADDR:PORT` (127.0.0.1 unless bound elsewhere; `https` when serving
    /// TLS), for `kube::Config::new`.
    pub fn url(&self) -> String {
        format!("{}://{}", if self.tls.is_some() { "https" } else { "http" }, self.addr)
    }

    fn store(&self) -> std::sync::MutexGuard<'_, Store> {
        self.shared.store.lock().expect("store lock")
    }

    /// The index of a resource named as `ResourceSpec::qualified` (`services`, `leases.coordination.k8s.io`).
    fn index(store: &Store, resource: &str) -> usize {
        store.resources.iter().position(|r| r.qualified() == resource).unwrap_or_else(|| {
            let known: Vec<_> = store.resources.iter().map(ResourceSpec::qualified).collect();
            panic!("resource {resource:?} is not registered (registered: {known:?})")
        })
    }

    /// Creates or replaces an object as given, status included (a fixture, not a
    /// client write: no precondition unless the object carries a resourceVersion).
    /// The registry's own rules apply (defaults, allocation, validation: a fixture
    /// the real server would refuse is refused), admission does not (a fixture Node
    /// is one whose kubelet registered it and whose not-ready taint is gone).
    /// Watches see it like any write. Panics if the resource is not registered.
    pub fn insert(&self, resource: &str, obj: Value) -> Result<Value, ApiError> {
        let mut store = self.store();
        let i = Self::index(&store, resource);
        let ns = obj["metadata"]["namespace"].as_str().map(str::to_owned);
        let name = obj["metadata"]["name"].as_str().unwrap_or("").to_owned();
        let written = if store.get(i, ns.as_deref(), &name).is_ok() {
            store.update(i, ns.as_deref(), &name, obj, Part::Whole)
        } else {
            store.create(i, ns.as_deref(), obj, Part::Whole)
        };
        written.map(|w| w.object)
    }

    pub fn get(&self, resource: &str, namespace: Option<&str>, name: &str) -> Option<Value> {
        let store = self.store();
        store.get(Self::index(&store, resource), namespace, name).ok()
    }

    /// Every object of the resource (of one namespace, if given), by namespace and name.
    pub fn list(&self, resource: &str, namespace: Option<&str>) -> Vec<Value> {
        let store = self.store();
        let i = Self::index(&store, resource);
        store.list(i, |o| namespace.is_none_or(|ns| o["metadata"]["namespace"].as_str() == Some(ns)))
    }

    pub fn remove(&self, resource: &str, namespace: Option<&str>, name: &str) -> Option<Value> {
        let mut store = self.store();
        let i = Self::index(&store, resource);
        store.delete(i, namespace, name, &Value::Null).ok()
    }

    /// The global resourceVersion: the RV of the last write.
    pub fn resource_version(&self) -> u64 {
        self.store().rv
    }

    /// Forgets the event history and ends every open watch (as an etcd compaction
    /// followed by a watch-cache re-initialisation would): a client resuming from
    /// any RV it holds gets 410 Expired and has to re-list.
    pub fn compact(&self) {
        self.store().compact();
    }

    /// Ends every open watch cleanly (as an API server restart would); clients resume from their RV.
    pub fn close_watches(&self) {
        let _ = self.store().tx.send(store::Msg::Close);
    }

    /// Watches open now.
    pub fn open_watches(&self) -> usize {
        self.store().tx.receiver_count()
    }

    /// An outage, as when the API server process goes away: the listener closes (new
    /// connections are refused) and every connection, open watches included, ends.
    /// The store stays; [`ApiServer::restart`] serves it again on the same address.
    pub async fn stop(&mut self) {
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
        // Graceful shutdown waits for the connections to close: end the watches (again,
        // for one that started while the shutdown spread), then give up on stragglers.
        let deadline = tokio::time::Instant::now() + Duration::from_secs(3);
        while !self.task.is_finished() && tokio::time::Instant::now() < deadline {
            self.close_watches();
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        self.task.abort();
    }

    /// Serves again after [`ApiServer::stop`], on the same address, from the same store
    /// (call [`ApiServer::compact`] first to have resumed watches get 410, as from
    /// the fresh watch cache of a restarted server).
    pub async fn restart(&mut self) -> anyhow::Result<()> {
        anyhow::ensure!(self.shutdown.is_none(), "the server is running");
        // The port may take a moment to be free again.
        let mut tries = 0;
        let listener = loop {
            match tokio::net::TcpListener::bind(self.addr).await {
                Ok(l) => break l,
                Err(_) if tries < 50 => {
                    tries += 1;
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                Err(e) => return Err(e.into()),
            }
        };
        self.restart_on(listener)
    }

    /// [`ApiServer::restart`] on a listener bound by the caller (on this server's
    /// address, in a network namespace of its own, say).
    pub fn restart_on(&mut self, listener: tokio::net::TcpListener) -> anyhow::Result<()> {
        anyhow::ensure!(self.shutdown.is_none(), "the server is running");
        anyhow::ensure!(listener.local_addr()? == self.addr, "the listener is not on {}", self.addr);
        let (task, shutdown) = serve_on(listener, self.shared.clone(), self.tls.clone());
        self.task = task;
        self.shutdown = Some(shutdown);
        Ok(())
    }

    /// Where it serves.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The User-Agents requests came with so far.
    pub fn user_agents(&self) -> std::collections::BTreeSet<String> {
        self.shared.user_agents.lock().expect("user agents").clone()
    }

    /// Requests served of one kind (failed ones included).
    pub fn requests(&self, verb: Verb) -> u64 {
        self.shared.requests[verb as usize].load(Ordering::Relaxed)
    }
}

fn json_response(code: u16, v: &Value) -> Response {
    let status = StatusCode::from_u16(code).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    (status, [(header::CONTENT_TYPE, "application/json")], serde_json::to_vec(v).expect("serializable")).into_response()
}

/// A written object, with the server's warnings as the real server sends them
/// (`Warning: 299 - "unknown field \"spec.foo\""`).
fn written_response(code: u16, w: &store::Written) -> Response {
    let mut r = json_response(code, &w.object);
    for text in &w.warnings {
        let quoted = format!("299 - \"{}\"", text.replace('\\', "\\\\").replace('"', "\\\""));
        if let Ok(v) = header::HeaderValue::from_str(&quoted) {
            r.headers_mut().append(header::WARNING, v);
        }
    }
    r
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        json_response(self.code, &self.to_json())
    }
}

/// `a=b&c=d%3De` into a map (form encoding: `+` is a space).
fn parse_query(q: Option<&str>) -> HashMap<String, String> {
    fn decode(s: &str) -> String {
        let b = s.as_bytes();
        let mut out = Vec::with_capacity(b.len());
        let mut i = 0;
        while i < b.len() {
            match b[i] {
                b'+' => out.push(b' '),
                b'%' => match b.get(i + 1..i + 3).and_then(|h| u8::from_str_radix(std::str::from_utf8(h).ok()?, 16).ok()) {
                    Some(v) => {
                        out.push(v);
                        i += 2;
                    }
                    None => out.push(b'%'),
                },
                c => out.push(c),
            }
            i += 1;
        }
        String::from_utf8_lossy(&out).into_owned()
    }
    q.unwrap_or("")
        .split('&')
        .filter(|p| !p.is_empty())
        .map(|p| {
            let (k, v) = p.split_once('=').unwrap_or((p, ""));
            (decode(k), decode(v))
        })
        .collect()
}

/// A request path resolved against the registered resources.
struct Target {
    res: usize,
    namespace: Option<String>,
    name: Option<String>,
    status: bool,
}

/// `/api/v1/...` or `/apis/{group}/{version}/...`: `[namespaces/{ns}/]{plural}[/{name}[/status]]`.
fn resolve(resources: &[ResourceSpec], path: &str) -> Option<Target> {
    let segs: Vec<&str> = path.trim_matches('/').split('/').collect();
    let (group, version, rest) = match segs.as_slice() {
        ["api", v, rest @ ..] => ("", *v, rest),
        ["apis", g, v, rest @ ..] => (*g, *v, rest),
        _ => return None,
    };
    let find = |plural: &str, namespaced: bool| {
        resources.iter().position(|r| r.group == group && r.version == version && r.plural == plural && r.namespaced == namespaced)
    };
    let (namespace, rest) = match rest {
        ["namespaces", ns, plural, ..] if find(plural, true).is_some() => (Some(ns.to_string()), &rest[2..]),
        _ => (None, rest),
    };
    let (plural, name, status) = match rest {
        [plural] => (*plural, None, false),
        [plural, name] => (*plural, Some(name.to_string()), false),
        [plural, name, "status"] => (*plural, Some(name.to_string()), true),
        _ => return None,
    };
    // A namespaced resource without a namespace: only its all-namespaces list/watch.
    let res = match namespace {
        Some(_) => find(plural, true)?,
        None if name.is_none() => find(plural, false).or_else(|| find(plural, true))?,
        None => find(plural, false)?,
    };
    Some(Target { res, namespace, name, status })
}

async fn handle(State(shared): State<Arc<Shared>>, method: Method, uri: Uri, headers: HeaderMap, body: Bytes) -> Response {
    let agent = headers.get(header::USER_AGENT).map_or("(none)".into(), |v| String::from_utf8_lossy(v.as_bytes()).into_owned());
    shared.user_agents.lock().expect("user agents").insert(agent);
    let auth = headers.get(header::AUTHORIZATION).map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned());
    let user = match User::authenticate(auth.as_deref()) {
        Ok(u) => u,
        Err(e) => return e.into_response(),
    };
    match serve(&shared, &user, &method, &uri, &headers, &body) {
        Ok(r) => r,
        Err(e) => e.into_response(),
    }
}

fn count(shared: &Shared, verb: Verb) {
    shared.requests[verb as usize].fetch_add(1, Ordering::Relaxed);
}

fn parse_body(body: &Bytes) -> Result<Value, ApiError> {
    serde_json::from_slice(body).map_err(|e| ApiError::new(400, "BadRequest", format!("invalid JSON body: {e}")))
}

fn serve(shared: &Arc<Shared>, user: &User, method: &Method, uri: &Uri, headers: &HeaderMap, body: &Bytes) -> Result<Response, ApiError> {
    let resources = shared.store.lock().expect("store lock").resources.clone();
    if let Some(doc) = discovery(&resources, uri.path()) {
        return Ok(json_response(200, &doc));
    }
    if *method == Method::POST && uri.path() == "/apis/authentication.k8s.io/v1/selfsubjectreviews" {
        return Ok(json_response(201, &user.self_subject_review()));
    }
    let not_found = || ApiError::new(404, "NotFound", "the server could not find the requested resource".into());
    let t = resolve(&resources, uri.path()).ok_or_else(not_found)?;
    let spec = resources[t.res];
    let q = parse_query(uri.query());
    let ns = t.namespace.as_deref();
    let part = if t.status { Part::Status } else { Part::Main };
    if t.status && !spec.status {
        return Err(not_found());
    }
    authorize(shared, user, method, &spec, &t, &q)?;
    let lock = || shared.store.lock().expect("store lock");
    let method_not_allowed = || ApiError::new(405, "MethodNotAllowed", "the server does not allow this method on the requested resource".into());
    let obj = match (method.clone(), t.name.as_deref()) {
        (Method::GET, None) => {
            let filter = select::Filter::new(ns, q.get("labelSelector").map(String::as_str), q.get("fieldSelector").map(String::as_str))?;
            if matches!(q.get("watch").map(String::as_str), Some("true" | "1")) {
                count(shared, Verb::Watch);
                let wq = watch::WatchQuery {
                    resource_version: q.get("resourceVersion").cloned(),
                    // The real server picks 30-60 minutes when the client gives none.
                    timeout: Duration::from_secs(q.get("timeoutSeconds").and_then(|s| s.parse().ok()).unwrap_or(1800)),
                    bookmarks: q.get("allowWatchBookmarks").is_some_and(|b| b == "true"),
                    send_initial_events: q.get("sendInitialEvents").is_some_and(|b| b == "true"),
                };
                let body: Body = watch::start(shared, t.res, filter, wq)?;
                return Ok(([(header::CONTENT_TYPE, "application/json")], body).into_response());
            }
            count(shared, Verb::List);
            let store = lock();
            let items = store.list(t.res, |o| filter.matches(o));
            let list = json!({
                "apiVersion": spec.api_version(), "kind": format!("{}List", spec.kind),
                "metadata": { "resourceVersion": store.rv.to_string() }, "items": items,
            });
            return Ok(json_response(200, &list));
        }
        (Method::POST, None) if !t.status => {
            count(shared, Verb::Create);
            let w = lock().create(t.res, ns, parse_body(body)?, part)?;
            return Ok(written_response(201, &w));
        }
        (Method::GET, Some(name)) => {
            count(shared, Verb::Get);
            lock().get(t.res, ns, name)?
        }
        (Method::PUT, Some(name)) => {
            count(shared, Verb::Update);
            let w = lock().update(t.res, ns, name, parse_body(body)?, part)?;
            return Ok(written_response(200, &w));
        }
        (Method::PATCH, Some(name)) => {
            count(shared, Verb::Patch);
            let ct = headers.get(header::CONTENT_TYPE).and_then(|v| v.to_str().ok()).unwrap_or("");
            if ct.starts_with("application/apply-patch+yaml") && t.status {
                let Some(manager) = q.get("fieldManager").filter(|m| !m.is_empty()) else {
                    let cause =
                        Cause { reason: "FieldValueRequired", message: "Required value: is required for apply patch".into(), field: "fieldManager".into() };
                    let mut e = ApiError::new(
                        422,
                        "Invalid",
                        "PatchOptions.meta.k8s.io \"\" is invalid: fieldManager: Required value: is required for apply patch".into(),
                    );
                    e.details = Some(
                        json!({ "group": "meta.k8s.io", "kind": "PatchOptions", "causes": [{ "reason": cause.reason, "message": cause.message, "field": cause.field }] }),
                    );
                    return Err(e);
                };
                let force = q.get("force").is_some_and(|f| f == "true");
                let w = lock().apply_status(t.res, ns, name, manager, force, parse_body(body)?)?;
                return Ok(written_response(200, &w));
            }
            if !ct.starts_with("application/merge-patch+json") {
                return Err(ApiError::new(
                    415,
                    "UnsupportedMediaType",
                    format!("the body of the request was in an unknown format ({ct}); only application/merge-patch+json is served here"),
                ));
            }
            let patch = parse_body(body)?;
            let mut store = lock();
            let mut obj = store.get(t.res, ns, name)?;
            merge_patch(&mut obj, &patch);
            // The patch's own resourceVersion, if any, is the precondition (as for PUT).
            let w = store.update(t.res, ns, name, obj, part)?;
            return Ok(written_response(200, &w));
        }
        (Method::DELETE, Some(name)) if !t.status => {
            count(shared, Verb::Delete);
            let opts = if body.is_empty() { Value::Null } else { parse_body(body)? };
            lock().delete(t.res, ns, name, &opts["preconditions"])?
        }
        _ => return Err(method_not_allowed()),
    };
    Ok(json_response(200, &obj))
}

/// Refuses (403) what RBAC does not grant `user`; a list or watch selecting one
/// name by `metadata.name` is asked for that name, as the real server asks.
fn authorize(shared: &Shared, user: &User, method: &Method, spec: &ResourceSpec, t: &Target, q: &HashMap<String, String>) -> Result<(), ApiError> {
    let watch = matches!(q.get("watch").map(String::as_str), Some("true" | "1"));
    let verb = match (method.clone(), t.name.is_some()) {
        (Method::GET, true) => "get",
        (Method::GET, false) if watch => "watch",
        (Method::GET, false) => "list",
        (Method::POST, _) => "create",
        (Method::PUT, _) => "update",
        (Method::PATCH, _) => "patch",
        (Method::DELETE, _) => "delete",
        _ => return Ok(()),
    };
    let selected = q
        .get("fieldSelector")
        .and_then(|f| f.split(',').find_map(|r| r.strip_prefix("metadata.name==").or_else(|| r.strip_prefix("metadata.name="))))
        .filter(|_| t.name.is_none());
    let a = rbac::Attributes { verb, spec, status: t.status, namespace: t.namespace.as_deref(), name: t.name.as_deref().or(selected) };
    if shared.rbac.allows(user, &a) {
        Ok(())
    } else {
        Err(rbac::forbidden(user, &a))
    }
}

/// `/api`, `/apis`, `/apis/{group}`, `/api/v1`, `/apis/{group}/{version}`, `/version`.
fn discovery(resources: &[ResourceSpec], path: &str) -> Option<Value> {
    let segs: Vec<&str> = path.trim_matches('/').split('/').collect();
    let group_versions = |g: &str| {
        let mut vs: Vec<&str> = resources.iter().filter(|r| r.group == g).map(|r| r.version).collect();
        vs.dedup();
        vs
    };
    let api_group = |g: &str| -> Value {
        let versions: Vec<Value> = group_versions(g).iter().map(|v| json!({ "groupVersion": format!("{g}/{v}"), "version": v })).collect();
        json!({ "kind": "APIGroup", "apiVersion": "v1", "name": g, "preferredVersion": versions[0], "versions": versions })
    };
    let resource_list = |g: &str, v: &str| -> Option<Value> {
        let mut list = Vec::new();
        for r in resources.iter().filter(|r| r.group == g && r.version == v) {
            let verbs = ["create", "delete", "get", "list", "patch", "update", "watch"];
            list.push(json!({ "name": r.plural, "singularName": r.kind.to_lowercase(), "namespaced": r.namespaced, "kind": r.kind, "verbs": verbs }));
            if r.status {
                list.push(json!({ "name": format!("{}/status", r.plural), "singularName": "", "namespaced": r.namespaced, "kind": r.kind, "verbs": ["get", "patch", "update"] }));
            }
        }
        let gv = if g.is_empty() { v.to_owned() } else { format!("{g}/{v}") };
        (!list.is_empty()).then(|| json!({ "kind": "APIResourceList", "apiVersion": "v1", "groupVersion": gv, "resources": list }))
    };
    match segs.as_slice() {
        ["version"] => Some(json!({
            "major": "1", "minor": "33", "gitVersion": "v1.33.0", "gitCommit": "", "gitTreeState": "clean",
            "buildDate": "2025-04-23T00:00:00Z", "goVersion": "go1.24", "compiler": "gc", "platform": "linux/amd64",
        })),
        ["api"] => Some(json!({ "kind": "APIVersions", "versions": ["v1"], "serverAddressByClientCIDRs": [] })),
        ["apis"] => {
            let mut groups: Vec<&str> = resources.iter().map(|r| r.group).filter(|g| !g.is_empty()).collect();
            groups.sort();
            groups.dedup();
            let groups: Vec<Value> = groups.into_iter().map(api_group).collect();
            Some(json!({ "kind": "APIGroupList", "apiVersion": "v1", "groups": groups }))
        }
        ["apis", g] if !group_versions(g).is_empty() => Some(api_group(g)),
        ["api", v] => resource_list("", v),
        ["apis", g, v] => resource_list(g, v),
        _ => None,
    }
}
