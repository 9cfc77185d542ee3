//! The HA lab with Kubernetes as the source: an API server runs in a namespace of
//! the lab (198.18.0.2) and every node runs `vip-agent run --kubernetes`. The
//! server is the in-process stand-in ([`KubeLab::start`], HTTPS on port 6443), which
//! the agents reach as a DaemonSet's pods do: in-cluster config (the
//! deploy/10-rbac.yaml ServiceAccount's token and `ca.crt` mounted in a mount
//! namespace of each agent's own) through the `kubernetes` Service's address
//! ([`KUBERNETES_SERVICE`]), which each node's kube-proxy stand-in (an nft DNAT
//! rule in its namespace) sends to the server. Or a real kube-apiserver with etcd
//! ([`KubeLab::start_real`], TLS, the agents acting as the deploy/10-rbac.yaml
//! ServiceAccount through a kubeconfig). Shared by the Kubernetes e2e test and bench.
//!
//! Each node also answers HTTP on [`HEALTH_CHECK_NODE_PORT`], as kube-proxy does
//! on a Local-policy Service's `healthCheckNodePort`.
use std::{
    net::{IpAddr, SocketAddr},
    path::Path,
    process::{Child, Stdio},
    sync::mpsc,
};

use anyhow::{anyhow, Context as _, Result};
use http::Method;
use serde_json::{json, Value};

use crate::{
    agent::{InCluster, TempDir},
    apiserver::{service_account_token, ApiServer, ResourceSpec, Stack},
    halab::{node_addr, node_addr6, HaLab, HaSpec, Naming},
    kubeapi::{apply, ensure_namespace, raw, resource_path, Ca, Options, RealApiServer},
    netns::NetNs,
};

/// The API server's address in the lab (its namespace's eth0), on an IPv4 or
/// dual-stack cluster.
pub const API_HOST: &str = "198.18.0.2";
/// Its address on an IPv6-only cluster.
pub const API_HOST6: &str = "2001:2::2";
/// The API server's port.
pub const API_PORT: u16 = 6443;

/// The `kubernetes` Service's address (KUBERNETES_SERVICE_HOST) on an IPv4 or
/// dual-stack cluster, and on an IPv6-only one: in the lab's ranges (a real
/// cluster's is its service CIDR's first address, 10.96.0.1 on kubeadm's default).
pub const KUBERNETES_SERVICE: &str = "198.19.255.1";
pub const KUBERNETES_SERVICE6: &str = "2001:2:0:ff::1";

/// kubeadm's (and so kind's) control-plane node: this label and taint, and
/// [`EXCLUDE_FROM_LB_LABEL`](vip_agent::k8s::source::EXCLUDE_FROM_LB_LABEL).
pub const CONTROL_PLANE_LABEL: &str = "node-role.kubernetes.io/control-plane";

/// The cluster a lab stands in for.
#[derive(Clone, Copy, Debug, Default)]
pub struct Shape {
    /// The cluster's families: the Nodes' InternalIPs (the primary first), the
    /// service CIDRs and the API server's address. IPv6 needs [`HaSpec::ipv6`]
    /// (and IPv6-only [`HaSpec::ipv6_only`]).
    pub stack: Stack,
    /// The last this many of the lab's nodes are registered as kubeadm registers
    /// its control-plane nodes ([`CONTROL_PLANE_LABEL`]).
    pub control_planes: usize,
}

impl Shape {
    fn api_host(&self) -> IpAddr {
        match self.stack {
            Stack::V6 => API_HOST6,
            Stack::V4 | Stack::Dual => API_HOST,
        }
        .parse()
        .expect("an address")
    }

    /// Where pods reach the API: the `kubernetes` Service, port 443.
    fn kubernetes_service(&self) -> SocketAddr {
        let host = match self.stack {
            Stack::V6 => KUBERNETES_SERVICE6,
            Stack::V4 | Stack::Dual => KUBERNETES_SERVICE,
        };
        SocketAddr::new(host.parse().expect("an address"), 443)
    }

    /// The API namespace's address on the segment.
    fn api_cidr(&self) -> String {
        match self.api_host() {
            IpAddr::V4(a) => format!("{a}/24"),
            IpAddr::V6(a) => format!("{a}/64"),
        }
    }

    /// Node `i`'s InternalIPs in the lab, the primary first.
    pub fn node_ips(&self, i: usize) -> Vec<IpAddr> {
        self.stack.pick(IpAddr::V4(node_addr(i)), IpAddr::V6(node_addr6(i)))
    }

    /// Node `i` (of `n`) as it is registered: a worker, or a control-plane node.
    pub fn node(&self, n: usize, i: usize) -> Value {
        node_object_of(&format!("node-{}", i + 1), &self.node_ips(i), i + self.control_planes >= n)
    }
}
/// The `healthCheckNodePort` of the tests' Local-policy Services: a real API server
/// takes only 30000-32767 (nodePort range); every node serves HTTP 200 on it.
pub const HEALTH_CHECK_NODE_PORT: u16 = 32000;

/// The API server of a lab.
pub enum LabApi {
    /// The stand-in, and the runtime (in its namespace) that serves it.
    StandIn(ApiServer, StandInRuntime),
    Real(Box<RealApiServer>),
}

impl LabApi {
    pub fn is_real(&self) -> bool {
        matches!(self, LabApi::Real(_))
    }

    pub fn real(&self) -> Option<&RealApiServer> {
        match self {
            LabApi::Real(s) => Some(s),
            LabApi::StandIn(..) => None,
        }
    }

    pub fn get(&self, resource: &str, ns: Option<&str>, name: &str) -> Option<Value> {
        match self {
            LabApi::StandIn(api, _) => api.get(resource, ns, name),
            LabApi::Real(s) => {
                let path = format!("{}/{name}", resource_path(resource, ns));
                // An unreachable server (an outage) reads as "not there".
                s.block_on(|c| async move {
                    let r = raw(&c, Method::GET, &path, "", None).await?;
                    Ok(if r.status == 404 { None } else { Some(r.ok()?) })
                })
                .ok()
                .flatten()
            }
        }
    }

    pub fn list(&self, resource: &str, ns: Option<&str>) -> Vec<Value> {
        match self {
            LabApi::StandIn(api, _) => api.list(resource, ns),
            LabApi::Real(s) => {
                let path = resource_path(resource, ns);
                let l =
                    s.block_on(|c| async move { raw(&c, Method::GET, &path, "", None).await?.ok() }).unwrap_or_else(|e| panic!("listing {resource}: {e:#}"));
                l["items"].as_array().cloned().unwrap_or_default()
            }
        }
    }

    /// Deletes an object; whether it was there.
    pub fn delete(&self, resource: &str, ns: Option<&str>, name: &str) -> Result<bool> {
        match self {
            LabApi::StandIn(api, _) => Ok(api.remove(resource, ns, name).is_some()),
            LabApi::Real(s) => {
                let path = format!("{}/{name}", resource_path(resource, ns));
                s.block_on(|c| async move {
                    let r = raw(&c, Method::DELETE, &path, "", None).await?;
                    Ok(r.status != 404 && r.ok().is_ok())
                })
            }
        }
    }

    /// Stores `obj` as it is (the stand-in) or applies it (the real server, where
    /// a `status` is ignored except for Nodes, see [`register_node`]).
    pub fn insert(&self, resource: &str, obj: Value) -> Result<Value> {
        match self {
            LabApi::StandIn(api, _) => api.insert(resource, obj).map_err(|e| anyhow!("{e:?}")),
            LabApi::Real(s) if resource == "nodes" => s.block_on(|c| async move { register_node(&c, &obj).await }),
            LabApi::Real(s) => s.block_on(|c| async move {
                apply(&c, &obj, false).await?;
                let (ns, name) = (obj["metadata"]["namespace"].as_str(), obj["metadata"]["name"].as_str().unwrap_or_default());
                raw(&c, Method::GET, &format!("{}/{name}", resource_path(resource, ns)), "", None).await?.ok()
            }),
        }
    }
}

/// What a kubelet and the node controller do for a Node on a real server: creates
/// it (admission adds the `node.kubernetes.io/not-ready:NoSchedule` taint), sets
/// its addresses and conditions through the `status` subresource, and removes
/// that taint. Returns the Node.
pub async fn register_node(client: &kube::Client, node: &Value) -> Result<Value> {
    let name = node["metadata"]["name"].as_str().context("a Node without a name")?;
    let path = format!("/api/v1/nodes/{name}");
    let mut meta = node.clone();
    meta.as_object_mut().unwrap().remove("status");
    apply(client, &meta, false).await?;
    let merge = "application/merge-patch+json";
    raw(client, Method::PATCH, &format!("{path}/status"), merge, Some(&json!({ "status": node["status"] }))).await?.ok().context("Node status")?;
    crate::kubefix::lift_not_ready_taint(client, name).await
}

pub struct KubeLab {
    // Drop order: the health servers and the lab (agents) before the API and its namespace.
    _health: Children,
    pub lab: HaLab,
    pub api: LabApi,
    pub api_ns: NetNs,
    _tmp: TempDir,
}

/// Processes killed on Drop.
struct Children(Vec<Child>);

impl Drop for Children {
    fn drop(&mut self) {
        for c in &mut self.0 {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// The runtime a lab's stand-in runs on, its threads in the API's namespace; it
/// stops when this is dropped.
pub struct StandInRuntime {
    handle: tokio::runtime::Handle,
    _keep: mpsc::Sender<()>,
}

/// Runs the stand-in of a cluster of `stack`'s families inside `ns` (its runtime's
/// threads live there), serving HTTPS with `serving` (certificate and key, PEM),
/// until the returned runtime is dropped.
pub fn api_of(ns: &NetNs, addr: SocketAddr, stack: Stack, serving: (String, String)) -> Result<(ApiServer, StandInRuntime)> {
    let (tx, rx) = mpsc::channel();
    let (stop_tx, stop_rx) = mpsc::channel::<()>();
    ns.spawn(move || {
        let started = (|| -> Result<_> {
            let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
            let builder = ApiServer::builder().resources(ResourceSpec::VIP).stack(stack).bind(addr).bookmark_interval(std::time::Duration::from_secs(1));
            let api = rt.block_on(builder.tls(&serving.0, &serving.1)?.start())?;
            Ok((rt, api))
        })();
        match started {
            Ok((rt, api)) => {
                let _ = tx.send(Ok((api, rt.handle().clone())));
                let _ = stop_rx.recv(); // keep the runtime (and the server) alive
            }
            Err(e) => {
                let _ = tx.send(Err(e));
            }
        }
    })?;
    let (api, handle) = rx.recv()??;
    Ok((api, StandInRuntime { handle, _keep: stop_tx }))
}

/// The files the kubelet mounts for the DaemonSet's ServiceAccount (so that the
/// stand-in holds the agents to deploy/10-rbac.yaml as the real server does),
/// in `dir`/serviceaccount.
fn service_account_dir(dir: &Path, ca: &Ca) -> Result<std::path::PathBuf> {
    let sa = dir.join("serviceaccount");
    std::fs::create_dir_all(&sa)?;
    std::fs::write(sa.join("token"), service_account_token("vip-system", "vip-agent"))?;
    std::fs::write(sa.join("ca.crt"), ca.pem())?;
    std::fs::write(sa.join("namespace"), "vip-system")?;
    Ok(sa)
}

/// Starts `server_exe serve NAME HEALTH_CHECK_NODE_PORT` on every node (kube-proxy's
/// health check server).
fn health_servers(lab: &HaLab, server_exe: &Path) -> Result<Children> {
    let mut c = Children(Vec::new());
    for n in &lab.nodes {
        let child =
            n.ns.cmd(server_exe.to_str().context("server path")?)
                .args(["serve", &n.name, &HEALTH_CHECK_NODE_PORT.to_string()])
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .context("starting a health check server")?;
        c.0.push(child);
    }
    Ok(c)
}

impl KubeLab {
    /// Starts the lab (agents in Kubernetes mode), the stand-in in its namespace,
    /// and registers the lab's nodes as Ready Nodes labelled `lab=yes`.
    pub fn start(spec: HaSpec, server_exe: &Path) -> Result<Self> {
        Self::start_shaped(spec, Shape::default(), server_exe)
    }

    /// [`Self::start`] standing in for a cluster of `shape`.
    pub fn start_shaped(spec: HaSpec, shape: Shape, server_exe: &Path) -> Result<Self> {
        let tmp = TempDir::new("vip-kube-lab-")?;
        let ca = Ca::new()?;
        let service = shape.kubernetes_service();
        let api_addr = SocketAddr::new(shape.api_host(), API_PORT);
        let pod = InCluster { service_account: service_account_dir(&tmp.0, &ca)?, service, endpoint: api_addr };
        let spec = HaSpec { in_cluster: Some(pod), ..spec };
        // The agents start and wait for the API (their watches retry) while it comes up.
        let lab = HaLab::start(spec, Naming::Unique, server_exe)?;
        let health = health_servers(&lab, server_exe)?;
        let api_ns = lab.seg.plug(NetNs::new("vapi")?, &shape.api_cidr())?;
        // Its certificate names what the real server's does: its own address, the
        // Service's, and the Service's DNS names.
        let names = ["kubernetes", "kubernetes.default", "kubernetes.default.svc", "kubernetes.default.svc.cluster.local"];
        let serving = ca.server("kube-apiserver", &[api_addr.ip(), service.ip()], &names)?;
        let (api, keep) = api_of(&api_ns, api_addr, shape.stack, serving)?;
        let api = LabApi::StandIn(api, keep);
        for i in 0..lab.nodes.len() {
            api.insert("nodes", shape.node(lab.nodes.len(), i))?;
        }
        Ok(Self { _health: health, lab, api, api_ns, _tmp: tmp })
    }

    /// The same with a real kube-apiserver and etcd (`None`: no binaries, see
    /// [`crate::kubeapi::assets`]) in the API namespace on 198.18.0.2: the VipPool
    /// CRD, deploy/00-namespace.yaml and deploy/10-rbac.yaml applied, the namespace
    /// `shop` made, the Nodes registered as a kubelet would; then the agents start
    /// with a kubeconfig holding a token of the `vip-system/vip-agent` ServiceAccount.
    pub fn start_real(spec: HaSpec, server_exe: &Path) -> Result<Option<Self>> {
        Self::start_real_shaped(spec, Shape::default(), server_exe)
    }

    /// [`Self::start_real`] as a cluster of `shape` (the server started with its
    /// service CIDRs, on its API address).
    pub fn start_real_shaped(spec: HaSpec, shape: Shape, server_exe: &Path) -> Result<Option<Self>> {
        if crate::kubeapi::assets().is_none() {
            return Ok(None);
        }
        let tmp = TempDir::new("vip-kube-lab-")?;
        let mut lab = HaLab::build(spec, Naming::Unique, server_exe)?;
        let health = health_servers(&lab, server_exe)?;
        let api_ns = lab.seg.plug(NetNs::new("vapi")?, &shape.api_cidr())?;
        let opts = Options { host: shape.api_host(), netns: Some(api_ns.path()), ..Options::of(shape.stack) };
        let server = RealApiServer::start_with(opts).context("no KUBEBUILDER_ASSETS")?;
        let path = tmp.0.join("kubeconfig");
        let nodes: Vec<Value> = (0..lab.nodes.len()).map(|i| shape.node(lab.nodes.len(), i)).collect();
        let (srv, kc) = (&server, &path);
        server.block_on(|c| async move {
            srv.install_crd(&c).await?;
            ensure_namespace(&c, "shop").await?;
            srv.service_account_kubeconfig(&c, "vip-system", "vip-agent", kc).await?;
            for n in &nodes {
                register_node(&c, n).await?;
            }
            Ok(())
        })?;
        lab.spec.kubeconfig = Some(path);
        for i in 0..lab.nodes.len() {
            lab.start_agent(i)?;
        }
        Ok(Some(Self { _health: health, lab, api: LabApi::Real(Box::new(server)), api_ns, _tmp: tmp }))
    }
}

impl KubeLab {
    /// Connections node `i`'s processes opened to the `kubernetes` Service (the
    /// packets its kube-proxy stand-in rewrote: the first of each); None when the
    /// agents use a kubeconfig (the real server's lab).
    pub fn via_kubernetes_service(&self, i: usize) -> Option<u64> {
        let pod = self.lab.spec.in_cluster.as_ref()?;
        let family = if pod.service.is_ipv4() { "ip" } else { "ip6" };
        let text = self.lab.nodes[i].ns.nft(&["list", "chain", family, "kube-proxy", "output"]).ok()?;
        text.split("counter packets ").nth(1)?.split_whitespace().next()?.parse().ok()
    }

    /// An API-server outage begins: the stand-in's listener closes and every
    /// connection ends, its store kept; the real server is SIGKILLed, etcd kept.
    pub fn stop_api(&mut self) {
        match &mut self.api {
            LabApi::StandIn(api, rt) => rt.handle.block_on(api.stop()),
            LabApi::Real(s) => s.kill(),
        }
    }

    /// The outage ends: the API server serves its state again on its address (the
    /// real one once `/readyz` answers).
    pub fn start_api(&mut self) -> Result<()> {
        match &mut self.api {
            LabApi::StandIn(api, rt) => {
                let addr = api.addr();
                // Bound in the API's namespace; the port may take a moment to be free.
                let bound = self.api_ns.run(move || {
                    let mut tries = 0;
                    loop {
                        match std::net::TcpListener::bind(addr) {
                            Err(_) if tries < 50 => {
                                tries += 1;
                                std::thread::sleep(std::time::Duration::from_millis(100));
                            }
                            r => return r,
                        }
                    }
                })?;
                let listener = bound.with_context(|| format!("binding {addr} again"))?;
                listener.set_nonblocking(true)?;
                let _in_runtime = rt.handle.enter();
                api.restart_on(tokio::net::TcpListener::from_std(listener)?)
            }
            LabApi::Real(s) => s.restart().map(drop),
        }
    }
}

impl KubeLab {
    /// `kubectl ARGS` (/usr/bin/kubectl) as the admin against the real server, from
    /// the API's namespace; its standard output. Panics on the stand-in or a failure.
    pub fn kubectl(&self, args: &[&str]) -> String {
        let server = self.api.real().expect("kubectl runs against the real API server");
        let path = self._tmp.0.join("admin.kubeconfig");
        server.kubeconfig_admin(&path).expect("writing the admin kubeconfig");
        let out = self.api_ns.cmd("/usr/bin/kubectl").arg("--kubeconfig").arg(&path).args(args).output().expect("running kubectl");
        assert!(out.status.success(), "kubectl {args:?}: {}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8_lossy(&out.stdout).into_owned()
    }
}

/// A Ready Node with its InternalIP, labelled `lab=yes`.
pub fn node_object(name: &str, ip: &str) -> Value {
    node_object_of(name, &[ip.parse().expect("an address")], false)
}

/// A Ready Node with these InternalIPs (the primary first, as kubelet lists
/// them), labelled `lab=yes`; `control_plane`: labelled and tainted as kubeadm
/// does its control-plane nodes (`kubeadm init`'s mark-control-plane phase).
pub fn node_object_of(name: &str, ips: &[IpAddr], control_plane: bool) -> Value {
    let mut n = json!({
        "apiVersion": "v1", "kind": "Node",
        "metadata": { "name": name, "labels": { "lab": "yes", "kubernetes.io/hostname": name } },
        "status": {
            "addresses": ips.iter().map(|ip| json!({ "type": "InternalIP", "address": ip.to_string() })).chain([json!({ "type": "Hostname", "address": name })]).collect::<Vec<_>>(),
            "conditions": [{ "type": "Ready", "status": "True" }]
        }
    });
    if control_plane {
        let labels = &mut n["metadata"]["labels"];
        labels[CONTROL_PLANE_LABEL] = "".into();
        labels[vip_agent::k8s::source::EXCLUDE_FROM_LB_LABEL] = "".into();
        n["spec"] = json!({ "taints": [{ "key": CONTROL_PLANE_LABEL, "effect": "NoSchedule" }] });
    }
    n
}

/// A LoadBalancer Service `ns/name` on TCP 80; `local`: `externalTrafficPolicy: Local`
/// with [`HEALTH_CHECK_NODE_PORT`] as its `healthCheckNodePort`.
pub fn lb_service(ns: &str, name: &str, local: bool) -> Value {
    let mut s = json!({
        "apiVersion": "v1", "kind": "Service", "metadata": { "name": name, "namespace": ns },
        "spec": { "type": "LoadBalancer", "ports": [{ "port": 80, "protocol": "TCP" }],
                  "externalTrafficPolicy": if local { "Local" } else { "Cluster" } }
    });
    if local {
        s["spec"]["healthCheckNodePort"] = json!(HEALTH_CHECK_NODE_PORT);
    }
    s
}

/// Server-side apply of `obj` at its path under `resource` (named as
/// [`resource_path`] takes it): one request, without the discovery round trip of
/// [`apply`], for writes that are timed.
pub async fn apply_at(client: &kube::Client, resource: &str, obj: &Value) -> Result<Value> {
    let name = obj["metadata"]["name"].as_str().context("an object without a name")?;
    let path = format!("{}/{name}?fieldManager=vip-tests&force=true", resource_path(resource, obj["metadata"]["namespace"].as_str()));
    raw(client, Method::PATCH, &path, "application/apply-patch+yaml", Some(obj)).await?.ok().with_context(|| format!("applying {resource} {name}"))
}

/// An EndpointSlice of Service `svc` in `ns` with one ready endpoint on each of `nodes`.
pub fn endpoint_slice(ns: &str, svc: &str, nodes: &[&str]) -> Value {
    json!({
        "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
        "metadata": { "name": format!("{svc}-1"), "namespace": ns, "labels": { "kubernetes.io/service-name": svc } },
        "addressType": "IPv4",
        "endpoints": nodes.iter().map(|n| json!({ "addresses": ["10.0.0.1"], "nodeName": n, "conditions": { "ready": true } })).collect::<Vec<_>>()
    })
}

/// The backends in the ring of service `name` (`namespace/name`) as agent `i`'s
/// status reports them (written after its maps).
pub fn ring_backends(lab: &crate::halab::HaLab, i: usize, name: &str) -> Option<Vec<String>> {
    lab.status(i)?.services.into_iter().find(|x| x.name == name).map(|x| x.backends)
}
