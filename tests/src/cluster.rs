//! A real multi-node Kubernetes cluster on this machine, for the tests that run
//! vip the way users do: the DaemonSet on kubelet nodes with kube-proxy.
//!
//! # Topology
//!
//! Every address is in 198.18.0.0/15 (IPv4) or 2001:2::/48 (IPv6, both
//! benchmarking ranges) and exists only in namespaces the cluster made; nothing is added to the root namespace's addresses, routes, firewall,
//! bpffs, sysctls or `/run`.
//!
//! ```text
//!              segment namespace: bridge br0 (lab::Segment), 198.18.0.0/24
//!     ┌───────────────┬──────────────┬──────────────┬──────── … ─┬────────────────┐
//!   cp 198.18.0.2   node-1 .11     node-2 .12     node-N .(10+N)  client .100
//!   etcd            containerd     containerd                     (a machine on
//!   kube-apiserver  kubelet        kubelet                         the LAN)
//!   :6443           kube-proxy     kube-proxy
//!   controller-mgr  cni0 + pods    cni0 + pods
//!   scheduler       198.19.x.0/24  198.19.y.0/24
//! ```
//!
//! - Pods: `--cluster-cidr` [`CLUSTER_CIDR`], one /24 per node allocated by the
//!   controller manager (`spec.podCIDR`); the CNI config (bridge `cni0` +
//!   host-local) is written once the Node has it. Every node routes the other
//!   nodes' pod CIDRs via their addresses, and so does `cp` (pods reach the API
//!   server with their own addresses, as in a flat routed network); the client has
//!   no such routes (a test adds what it needs). No node has a default route: a
//!   stray packet to an address outside the lab fails on the spot; the service
//!   range is routed via `cp` instead (a packet the node itself sends to a
//!   ClusterIP needs a route before kube-proxy's DNAT applies; cp forwards nothing).
//! - Services: [`SERVICE_CIDR`]; the `kubernetes` Service ([`KUBERNETES_SERVICE_IP`]:443)
//!   gets `198.18.0.2:6443` as its endpoint from the API server's lease endpoint
//!   reconciler, and kube-proxy carries it there, so in-cluster clients work as in
//!   a real cluster. No cluster DNS runs ([`CLUSTER_DNS`] is only configured).
//! - Families ([`ClusterSpec::stack`]): IPv4 as drawn; IPv6-only has the IPv6
//!   twins instead (cp `2001:2::2`, node-N `2001:2::(10+N)` hex, client
//!   `2001:2::100`, on 2001:2::/64; pods [`CLUSTER_CIDR6`], a /64 per node;
//!   Services [`SERVICE_CIDR6`]); dual-stack has both, IPv4 primary (the Nodes'
//!   InternalIPs, `spec.podCIDRs`, the service ranges and the CNI ranges list
//!   IPv4 first, as kubeadm's dual-stack clusters do).
//! - Node links are veths on the bridge with the lab's conventions (an XDP_PASS
//!   program on the bridge port, checksums finished by the sender: see
//!   [`crate::lab::wire_port`]), so vip's XDP works in native mode on a node's
//!   `eth0`. [`Cluster::segment`] cuts or restores a node's link.
//!
//! # A node
//!
//! A network namespace, plus a *holder* process (`sleep`) that owns a private
//! mount namespace and UTS namespace (hostname = node name). containerd, the
//! kubelet and kube-proxy run in all three; [`Node::command`] enters them too. In
//! the mount namespace (made private, so nothing propagates back to the host):
//! - a fresh bpffs on `/sys/fs/bpf`: a pod's `hostPath: /sys/fs/bpf` (vip's
//!   pinned program and maps) lands in the node's own bpffs, not the machine's;
//! - `/run`, `/var/lib` and `/var/log` are directories of the node's work dir:
//!   containerd 1.6 hard-codes `/run/containerd` (shim sockets, runc state), the
//!   kubelet `/var/lib/kubelet` (device plugins) and `/var/log/{pods,containers}`,
//!   the CNI plugins their result cache in `/var/lib/cni`, and vip's DaemonSet
//!   mounts `hostPath: /run/vip`; several nodes on one machine need each their own;
//! - read-only files over 3 machine-wide sysctls the kubelet would otherwise
//!   rewrite at start (`vm.overcommit_memory`=1, `kernel.panic`=10,
//!   `kernel.panic_on_oops`=1): it reads the values it wants and writes nothing
//!   (`protectKernelDefaults: true` would refuse to start instead).
//!
//! The other obstacles of a kubelet node on this kind of machine, and their fix:
//! - cgroup v1 (hybrid): the kubelet refuses it by default → `failCgroupV1: false`,
//!   `cgroupDriver: cgroupfs` (no systemd), and a `cgroupRoot` per node made in every
//!   hierarchy beforehand (cpuset's `cpus`/`mems` copied from the parent).
//!   containerd, the kubelet and kube-proxy run in `<root>/system`; the shims
//!   inherit containerd's, the pods are under `<root>/kubepods`: whatever is left
//!   in a node's cgroups at teardown is killed there.
//! - runc cannot set `oom_score_adj` below the caller's without `CAP_SYS_RESOURCE`
//!   → containerd `restrict_oom_score_adj = true`.
//! - pod network namespaces are pinned under containerd's state dir
//!   (`netns_mounts_under_state_dir`), not in the machine's `/run/netns`.
//! - containerd's `opt` plugin and the kubelet's and controller manager's
//!   flexvolume dirs would create directories in `/opt` and `/usr/libexec` → they
//!   point into the node's and the control plane's dirs.
//! - no IPVS in this kernel → kube-proxy runs in `nftables` or `iptables` mode
//!   ([`ProxyMode`]; [`Cluster::set_proxy_mode`] switches a running cluster), with
//!   its `conntrack` settings at 0 so that it writes no machine-wide conntrack sysctl.
//! - `kubectl logs`/`exec` need the API server to reach kubelets: it has a client
//!   certificate for them and prefers their InternalIP.
//! - images: no registry is reachable; OCI archives ([`ClusterSpec::images`]) are
//!   imported into every node's containerd (`ctr -n k8s.io images import`); pods
//!   use them with `imagePullPolicy: IfNotPresent` or `Never`.
//!
//! # Node lifecycle settings
//!
//! Shorter than the defaults, in about the same proportions, so that a node whose
//! kubelet stops goes NotReady (Ready `Unknown`, tainted
//! `node.kubernetes.io/unreachable`) 12-13 s later instead of about 50: kubelet
//! `nodeLeaseDurationSeconds: 10` (lease renewed every 2.5 s),
//! `nodeStatusUpdateFrequency: 3s`; controller manager `--node-monitor-period=1s`,
//! `--node-monitor-grace-period=12s` ([`NODE_MONITOR_GRACE_PERIOD`]). The kubelet's
//! `syncFrequency` is 10 s (1 min by default), so a changed Secret reaches a pod's
//! volume within about 10 s.
//!
//! # Life and teardown
//!
//! Processes are spawned by a [`Keeper`] thread with `PR_SET_PDEATHSIG`; a *reaper*
//! (a shell started first, in a session of its own) waits for the harness to close
//! a pipe, which also happens when the test binary dies, and then kills whatever
//! is left in the nodes' cgroups (shims, containers), deletes the network
//! namespaces and cgroups and removes the work directory (kept with
//! `VIP_KEEP_CLUSTER=1`). Mounts go with the mount namespaces. [`Cluster::shared`]
//! tears down at exit; a [`Cluster`] on Drop. [`Footprint`] checks afterwards
//! that nothing is left.
//!
//! Binaries: `kube-apiserver` and `etcd` from `$KUBEBUILDER_ASSETS`; `kubelet`,
//! `kube-proxy`, `kube-controller-manager`, `kube-scheduler` from
//! `$VIP_KUBE_NODE_ASSETS`; containerd, runc, the CNI plugins, nft and iptables
//! from Debian (`cargo xtask setup`); `/usr/bin/kubectl`.
//!
//! Logs of every component are in the work directory ([`Cluster::dir`]):
//! `control-plane/{etcd,kube-apiserver,kube-controller-manager,kube-scheduler}.log`,
//! `node-N/{containerd,kubelet,kube-proxy}.log`; errors carry their tails
//! ([`Cluster::diagnose`]).
use std::{
    collections::BTreeMap,
    ffi::{CString, OsStr},
    fs::File,
    io::{BufRead, BufReader, Read, Write},
    net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, TcpStream},
    os::{
        fd::{AsRawFd, OwnedFd},
        unix::{fs::PermissionsExt, process::CommandExt},
    },
    path::{Path, PathBuf},
    process::{Child, ChildStdin, Command, Output, Stdio},
    sync::{Mutex, OnceLock},
    time::{Duration, Instant},
};

use anyhow::{anyhow, bail, ensure, Context as _, Result};
use http::Method;
use serde_json::{json, Value};

use crate::{
    agent::write_atomic,
    apiserver::Stack,
    kubeapi::{self, enter, log_tail, raw, Keeper, Options, RealApiServer},
    lab::Segment,
    netns::{self, NetNs},
};

/// The directory of `kubelet`, `kube-proxy`, `kube-controller-manager` and
/// `kube-scheduler`.
pub const NODE_ASSETS_ENV: &str = "VIP_KUBE_NODE_ASSETS";
/// The control plane's address on the segment (API server on [`API_PORT`]).
pub const CP_ADDR: Ipv4Addr = Ipv4Addr::new(198, 18, 0, 2);
pub const API_PORT: u16 = 6443;
/// The client's address on the segment.
pub const CLIENT_ADDR: Ipv4Addr = Ipv4Addr::new(198, 18, 0, 100);
/// The segment's prefix length.
pub const PREFIX_LEN: u8 = 24;
/// Pod addresses: a /24 of it per node.
pub const CLUSTER_CIDR: &str = "198.19.0.0/16";
/// ClusterIPs.
pub const SERVICE_CIDR: &str = "198.18.128.0/20";
/// The `kubernetes` Service's ClusterIP (port 443).
pub const KUBERNETES_SERVICE_IP: Ipv4Addr = Ipv4Addr::new(198, 18, 128, 1);
/// The cluster DNS address pods are given (no DNS server runs).
pub const CLUSTER_DNS: Ipv4Addr = Ipv4Addr::new(198, 18, 128, 10);
/// The IPv6 twins of the addresses and ranges above (module docs: Families).
pub const CP_ADDR6: Ipv6Addr = Ipv6Addr::new(0x2001, 2, 0, 0, 0, 0, 0, 2);
pub const CLIENT_ADDR6: Ipv6Addr = Ipv6Addr::new(0x2001, 2, 0, 0, 0, 0, 0, 0x100);
pub const PREFIX_LEN6: u8 = 64;
/// Pod addresses: a /64 of it per node.
pub const CLUSTER_CIDR6: &str = "2001:2:1::/56";
/// ClusterIPs (the API server takes at most 20 host bits of an IPv6 range).
pub const SERVICE_CIDR6: &str = "2001:2:0:8000::/112";
pub const KUBERNETES_SERVICE_IP6: Ipv6Addr = Ipv6Addr::new(0x2001, 2, 0, 0x8000, 0, 0, 0, 1);
pub const CLUSTER_DNS6: Ipv6Addr = Ipv6Addr::new(0x2001, 2, 0, 0x8000, 0, 0, 0, 0xa);
/// kube-proxy's `/healthz` port on every node address.
pub const PROXY_HEALTHZ_PORT: u16 = 10256;
/// kube-proxy's metrics port on the node's loopback.
pub const PROXY_METRICS_PORT: u16 = 10249;
/// The controller manager's node lifecycle settings (module docs).
pub const NODE_MONITOR_PERIOD: Duration = Duration::from_secs(1);
pub const NODE_MONITOR_GRACE_PERIOD: Duration = Duration::from_secs(12);
/// The images `cargo xtask image` builds (`target/images/`, [`images_dir`]).
pub const TESTPOD_IMAGE: &str = "localhost/vip-testpod:1";
pub const TESTPOD_ARCHIVE: &str = "vip-testpod.oci.tar";
pub const AGENT_IMAGE: &str = "localhost/vip-agent:0.2.0";
pub const AGENT_ARCHIVE: &str = "vip-agent.oci.tar";

/// Where `cargo xtask image` writes the OCI archives.
pub fn images_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/images")
}

/// Node `i`'s address: 198.18.0.11, .12, …
pub fn node_addr(i: usize) -> Ipv4Addr {
    assert!(i < 80, "at most 80 nodes");
    Ipv4Addr::new(198, 18, 0, 11 + i as u8)
}

/// Node `i`'s IPv6 address: 2001:2::11, ::12, …
pub fn node_addr6(i: usize) -> Ipv6Addr {
    assert!(i < 80, "at most 80 nodes");
    Ipv6Addr::new(0x2001, 2, 0, 0, 0, 0, 0, 0x11 + i as u16)
}

/// Node `i`'s addresses in a cluster of `stack`, the primary first (its InternalIPs).
pub fn node_addrs(stack: Stack, i: usize) -> Vec<IpAddr> {
    stack.pick(node_addr(i).into(), node_addr6(i).into())
}

/// The client's addresses in a cluster of `stack`, the primary first.
pub fn client_addrs(stack: Stack) -> Vec<IpAddr> {
    stack.pick(CLIENT_ADDR.into(), CLIENT_ADDR6.into())
}

/// The control plane's addresses in a cluster of `stack`, the primary first (the
/// API server listens on the primary).
pub fn cp_addrs(stack: Stack) -> Vec<IpAddr> {
    stack.pick(CP_ADDR.into(), CP_ADDR6.into())
}

/// The pod ranges of a cluster of `stack` (`--cluster-cidr`), the primary first.
pub fn cluster_cidrs(stack: Stack) -> Vec<&'static str> {
    stack.pick(CLUSTER_CIDR, CLUSTER_CIDR6)
}

/// The service ranges of a cluster of `stack`, the primary first.
pub fn service_cidrs(stack: Stack) -> Vec<&'static str> {
    stack.pick(SERVICE_CIDR, SERVICE_CIDR6)
}

/// The address of `addrs` in `a`'s family (the same family's gateway, route, …).
fn same_family(addrs: &[IpAddr], a: &str) -> Option<IpAddr> {
    let v6 = a.contains(':');
    addrs.iter().copied().find(|x| x.is_ipv6() == v6)
}

/// `a` with the segment's prefix length of its family.
fn on_segment(a: IpAddr) -> String {
    format!("{a}/{}", if a.is_ipv4() { PREFIX_LEN } else { PREFIX_LEN6 })
}

/// Node `i`'s name: node-1, node-2, …
pub fn node_name(i: usize) -> String {
    format!("node-{}", i + 1)
}

/// kube-proxy's mode (this kernel has no IPVS).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ProxyMode {
    Nftables,
    Iptables,
}

impl ProxyMode {
    pub fn as_str(self) -> &'static str {
        match self {
            ProxyMode::Nftables => "nftables",
            ProxyMode::Iptables => "iptables",
        }
    }
}

/// What to bring up.
#[derive(Clone, Debug)]
pub struct ClusterSpec {
    /// Worker nodes (1 to 80).
    pub nodes: usize,
    pub proxy_mode: ProxyMode,
    /// OCI (or docker) archives imported into every node; each must name its image
    /// (`io.containerd.image.name` or a full `org.opencontainers.image.ref.name`).
    pub images: Vec<PathBuf>,
    /// containerd's sandbox ("pause") image: one of `images`.
    pub sandbox_image: String,
    /// The cluster's families (module docs: Families).
    pub stack: Stack,
}

impl Default for ClusterSpec {
    /// 2 nodes, kube-proxy in nftables mode, the testpod and agent images of
    /// `cargo xtask image`, the testpod as the sandbox image.
    fn default() -> Self {
        Self {
            nodes: 2,
            proxy_mode: ProxyMode::Nftables,
            images: vec![images_dir().join(TESTPOD_ARCHIVE), images_dir().join(AGENT_ARCHIVE)],
            sandbox_image: TESTPOD_IMAGE.into(),
            stack: Stack::V4,
        }
    }
}

fn in_ci() -> bool {
    std::env::var("CI").is_ok_and(|v| v == "true")
}

/// Skips (prints why, returns false) outside CI; fails in CI, where a cluster
/// test runs only when its binaries were supplied (tests/build.rs).
fn unavailable(why: String) -> bool {
    if in_ci() {
        panic!("CI=true but {why}: with the Kubernetes binaries supplied, the cluster tests must run");
    }
    eprintln!("skipping: {why}");
    false
}

/// The directory of the node binaries from `VIP_KUBE_NODE_ASSETS`; `None` (after
/// printing why) when it is not set. The cluster tests are built `#[ignore]`d
/// without it (tests/build.rs); one built with it that finds it gone fails.
pub fn node_assets() -> Option<PathBuf> {
    match std::env::var_os(NODE_ASSETS_ENV).filter(|v| !v.is_empty()) {
        Some(dir) => {
            let dir = PathBuf::from(dir);
            for bin in ["kubelet", "kube-proxy", "kube-controller-manager", "kube-scheduler"] {
                assert!(dir.join(bin).is_file(), "{NODE_ASSETS_ENV}={}: no {bin} there", dir.display());
            }
            Some(dir)
        }
        None if cfg!(real_cluster) => panic!("{NODE_ASSETS_ENV} was set when the tests were built and is not set now"),
        None => {
            eprintln!("not run: {NODE_ASSETS_ENV} is not set (a directory holding kubelet, kube-proxy, kube-controller-manager and kube-scheduler)");
            None
        }
    }
}

/// Whether a cluster of `spec` can run here: root, both asset directories and the
/// image archives (`cargo xtask image`). Missing ones skip the test (printed),
/// except with `CI=true`, where they fail it. Host tools are checked by
/// [`Cluster::start`] (`cargo xtask setup` installs them).
pub fn available(spec: &ClusterSpec) -> bool {
    if !netns::privileged() || kubeapi::assets().is_none() || node_assets().is_none() {
        return false;
    }
    match spec.images.iter().find(|p| !p.is_file()) {
        Some(p) => unavailable(format!("no image archive {} (`cargo xtask image` builds them)", p.display())),
        None => true,
    }
}

/// The host tools a node needs, checked up front for a clear error.
fn check_host_tools() -> Result<()> {
    let mut missing = Vec::new();
    for (bin, pkg) in [
        ("containerd", "containerd"),
        ("ctr", "containerd"),
        ("containerd-shim-runc-v2", "containerd"),
        ("runc", "runc"),
        ("nft", "nftables"),
        ("iptables", "iptables"),
        ("mount", "mount"),
    ] {
        if !in_path(bin) {
            missing.push(format!("{bin} ({pkg})"));
        }
    }
    for p in ["bridge", "host-local", "loopback"] {
        if !Path::new(CNI_BIN_DIR).join(p).is_file() {
            missing.push(format!("{CNI_BIN_DIR}/{p} (containernetworking-plugins)"));
        }
    }
    if !Path::new(KUBECTL).is_file() {
        missing.push(format!("{KUBECTL} (kubectl, not from Debian)"));
    }
    ensure!(missing.is_empty(), "missing on this machine: {} (`cargo xtask setup` installs the Debian ones)", missing.join(", "));
    Ok(())
}

fn in_path(bin: &str) -> bool {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path).chain([PathBuf::from("/usr/sbin"), PathBuf::from("/sbin")]).any(|d| {
        let p = d.join(bin);
        p.metadata().is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
    })
}

const CNI_BIN_DIR: &str = "/usr/lib/cni";
const KUBECTL: &str = "/usr/bin/kubectl";

/// Runs a command, failing with its stderr (and stdout) when it fails.
fn run_ok(cmd: &mut Command) -> Result<Output> {
    let what = format!("{:?}", cmd);
    let o = cmd.stdin(Stdio::null()).output().with_context(|| format!("starting {what}"))?;
    if !o.status.success() {
        bail!("{what} failed ({}): {}{}", o.status, String::from_utf8_lossy(&o.stderr), String::from_utf8_lossy(&o.stdout));
    }
    Ok(o)
}

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

/// Polls `f` every `every` until it returns `Some`, or fails after `timeout` with
/// `what` and the last error.
fn poll<T>(what: &str, timeout: Duration, every: Duration, mut f: impl FnMut() -> Result<Option<T>>) -> Result<T> {
    let deadline = Instant::now() + timeout;
    let mut last = String::new();
    loop {
        match f() {
            Ok(Some(v)) => return Ok(v),
            Ok(None) => {}
            Err(e) => last = format!(": {e:#}"),
        }
        if Instant::now() > deadline {
            bail!("{what}: not within {timeout:?}{last}");
        }
        std::thread::sleep(every);
    }
}

/// A plain HTTP/1.0 GET from inside `ns` (1 s timeouts): status and body.
pub fn http_get(ns: &NetNs, addr: SocketAddr, path: &str) -> Result<(u16, String)> {
    let path = path.to_owned();
    ns.run(move || -> Result<(u16, String)> {
        let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(1))?;
        s.set_read_timeout(Some(Duration::from_secs(1)))?;
        s.set_write_timeout(Some(Duration::from_secs(1)))?;
        write!(s, "GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n")?;
        let mut out = String::new();
        s.read_to_string(&mut out)?;
        let status = out.split_whitespace().nth(1).and_then(|c| c.parse().ok()).ok_or_else(|| anyhow!("not HTTP: {out:?}"))?;
        Ok((status, out.split_once("\r\n\r\n").map(|(_, b)| b.to_owned()).unwrap_or_default()))
    })?
}

/// One TCP exchange from inside `ns` (3 s timeouts): reads the first line the
/// server sends, then sends each of `lines` and reads its echo. Returns the first
/// line and the echoes (the testpod's `serve`: its pod's name, then echoes).
pub fn converse(ns: &NetNs, addr: SocketAddr, lines: &[&str]) -> Result<Answer> {
    let lines: Vec<String> = lines.iter().map(|l| l.to_string()).collect();
    ns.run(move || -> Result<Answer> {
        let s = TcpStream::connect_timeout(&addr, Duration::from_secs(3)).with_context(|| format!("connecting to {addr}"))?;
        s.set_read_timeout(Some(Duration::from_secs(3)))?;
        let mut w = s.try_clone()?;
        let mut r = BufReader::new(s);
        let mut first = String::new();
        r.read_line(&mut first).with_context(|| format!("reading from {addr}"))?;
        let (pod, peer) = first.trim_end().split_once(' ').with_context(|| format!("{addr}: greeting {first:?} is not \"POD PEER\""))?;
        let mut answer = Answer { pod: pod.to_owned(), peer: peer.parse().with_context(|| format!("{addr}: peer {peer:?}"))?, echoes: Vec::new() };
        for l in &lines {
            writeln!(w, "{l}")?;
            let mut e = String::new();
            r.read_line(&mut e)?;
            answer.echoes.push(e.trim_end().to_owned());
        }
        Ok(answer)
    })?
}

/// What the testpod's echo server says on a connection: its pod name, the client
/// address it sees (kube-proxy's masquerade shows here), then each line echoed.
#[derive(Debug, Clone)]
pub struct Answer {
    pub pod: String,
    pub peer: SocketAddr,
    pub echoes: Vec<String>,
}

// ---------------------------------------------------------------- processes

/// Long-running processes by name, killed on Drop.
#[derive(Default)]
struct Daemons(Mutex<BTreeMap<&'static str, Child>>);

impl Daemons {
    fn insert(&self, name: &'static str, child: Child) {
        if let Some(mut old) = self.0.lock().unwrap().insert(name, child) {
            let _ = old.kill();
            let _ = old.wait();
        }
    }

    /// SIGTERM, then SIGKILL after `grace`; false if it was not running.
    fn stop(&self, name: &str, grace: Duration) -> bool {
        let Some(mut c) = self.0.lock().unwrap().remove(name) else { return false };
        if c.try_wait().ok().flatten().is_none() {
            // SAFETY: signalling our own child, not yet reaped.
            unsafe { libc::kill(c.id() as i32, libc::SIGTERM) };
            let deadline = Instant::now() + grace;
            while c.try_wait().ok().flatten().is_none() && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(20));
            }
        }
        let _ = c.kill();
        let _ = c.wait();
        true
    }

    fn kill_all(&self) {
        let mut m = self.0.lock().unwrap_or_else(|e| e.into_inner());
        for (_, mut c) in std::mem::take(&mut *m) {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    fn pid(&self, name: &str) -> Option<u32> {
        self.0.lock().unwrap().get(name).map(|c| c.id())
    }

    fn pids(&self) -> Vec<(&'static str, u32)> {
        self.0.lock().unwrap().iter().map(|(n, c)| (*n, c.id())).collect()
    }

    /// Fails naming the first that exited.
    fn check(&self, logs: impl Fn(&str) -> PathBuf) -> Result<()> {
        for (name, c) in self.0.lock().unwrap().iter_mut() {
            if let Some(st) = c.try_wait()? {
                bail!("{name} exited ({st}); {}:\n{}", logs(name).display(), log_tail(&logs(name), 30));
            }
        }
        Ok(())
    }
}

impl Drop for Daemons {
    fn drop(&mut self) {
        self.kill_all();
    }
}

fn append_log(path: &Path) -> Result<(Stdio, Stdio)> {
    let f = File::options().create(true).append(true).open(path).with_context(|| path.display().to_string())?;
    Ok((Stdio::from(f.try_clone()?), Stdio::from(f)))
}

// ---------------------------------------------------------------- cgroups

/// The mounted cgroup hierarchies (v1 controllers, named ones, the v2 tree),
/// each once.
fn cgroup_hierarchies() -> Result<Vec<PathBuf>> {
    const CGROUP_SUPER_MAGIC: i64 = 0x27e0eb;
    const CGROUP2_SUPER_MAGIC: i64 = 0x6367_7270;
    let fs_type = |p: &Path| -> Option<i64> {
        let c = CString::new(p.as_os_str().as_encoded_bytes()).ok()?;
        // SAFETY: a valid path and a zeroed statfs to fill.
        let mut st: libc::statfs = unsafe { std::mem::zeroed() };
        (unsafe { libc::statfs(c.as_ptr(), &mut st) } == 0).then_some(st.f_type as i64)
    };
    let root = Path::new("/sys/fs/cgroup");
    if fs_type(root) == Some(CGROUP2_SUPER_MAGIC) {
        return Ok(vec![root.to_owned()]);
    }
    let mut out = Vec::new();
    for e in std::fs::read_dir(root).context("/sys/fs/cgroup")? {
        let p = std::fs::canonicalize(e?.path())?;
        if matches!(fs_type(&p), Some(CGROUP_SUPER_MAGIC | CGROUP2_SUPER_MAGIC)) && !out.contains(&p) {
            out.push(p);
        }
    }
    out.sort();
    ensure!(!out.is_empty(), "no cgroup hierarchy under /sys/fs/cgroup");
    Ok(out)
}

/// Makes `dir` (and missing parents up to the hierarchy) with cpuset's cpus and
/// mems copied from its parent, where the hierarchy has them (a v1 cpuset cgroup
/// takes no process before).
fn make_cgroup(dir: &Path) -> Result<()> {
    if dir.is_dir() {
        return Ok(());
    }
    std::fs::create_dir(dir).with_context(|| format!("making cgroup {}", dir.display()))?;
    let parent = dir.parent().context("a cgroup without parent")?;
    for f in ["cpuset.cpus", "cpuset.mems"] {
        if dir.join(f).exists() {
            let v = std::fs::read_to_string(parent.join(f))?;
            std::fs::write(dir.join(f), v.trim()).with_context(|| format!("{}/{f}", dir.display()))?;
        }
    }
    Ok(())
}

/// Makes `cmd`'s child join the cgroups `dirs` (their `cgroup.procs` opened here,
/// written in the child before it executes).
fn join_cgroups(cmd: &mut Command, dirs: &[PathBuf]) -> Result<()> {
    let files: Vec<OwnedFd> = dirs
        .iter()
        .map(|d| File::options().write(true).open(d.join("cgroup.procs")).map(OwnedFd::from).with_context(|| d.display().to_string()))
        .collect::<Result<_>>()?;
    // SAFETY: write(2) only, between fork and exec.
    unsafe {
        cmd.pre_exec(move || {
            for f in &files {
                // "0": the writing process itself.
                if libc::write(f.as_raw_fd(), b"0".as_ptr().cast(), 1) != 1 {
                    return Err(std::io::Error::last_os_error());
                }
            }
            Ok(())
        });
    }
    Ok(())
}

/// Resident memory of a process in bytes (0 if gone).
fn rss(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| s.lines().find(|l| l.starts_with("VmRSS:")).and_then(|l| l.split_whitespace().nth(1)?.parse::<u64>().ok()))
        .unwrap_or(0)
        * 1024
}

/// Every process id in a cgroup tree.
fn cgroup_pids(dir: &Path) -> Vec<u32> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_owned()];
    while let Some(d) = stack.pop() {
        if let Ok(s) = std::fs::read_to_string(d.join("cgroup.procs")) {
            out.extend(s.lines().filter_map(|l| l.parse::<u32>().ok()));
        }
        if let Ok(rd) = std::fs::read_dir(&d) {
            stack.extend(rd.flatten().filter(|e| e.file_type().is_ok_and(|t| t.is_dir())).map(|e| e.path()));
        }
    }
    out.sort_unstable();
    out.dedup();
    out
}

// ---------------------------------------------------------------- reaper

/// Waits for EOF on stdin (the harness closed its end: dropped the cluster, exited
/// or died), then removes what the kernel does not remove by itself. Bounded: 10 s
/// of killing, 5 s of cgroup removal.
const REAPER_SCRIPT: &str = r#"
read -r _ || :
i=0
while [ $i -lt 100 ]; do
  pids=$(for c in $VIP_REAP_CGROUPS; do [ -d "$c" ] && find "$c" -name cgroup.procs -exec cat {} + 2>/dev/null; done)
  [ -z "$pids" ] && break
  kill -9 $pids 2>/dev/null
  sleep 0.1
  i=$((i + 1))
done
for n in $VIP_REAP_NETNS; do ip netns del "$n" 2>/dev/null; done
i=0
while [ $i -lt 50 ]; do
  left=
  for c in $VIP_REAP_CGROUPS; do
    [ -d "$c" ] || continue
    find "$c" -depth -type d -exec rmdir {} + 2>/dev/null
    [ -d "$c" ] && left=1
  done
  [ -z "$left" ] && break
  sleep 0.1
  i=$((i + 1))
done
if [ "$VIP_REAP_KEEP" != 1 ]; then
  rm -rf "$VIP_REAP_DIR" 2>/dev/null || { sleep 0.5; rm -rf "$VIP_REAP_DIR"; }
fi
"#;

/// The reaper process (see [`REAPER_SCRIPT`]); dropping it runs the cleanup and
/// waits for it.
struct Reaper {
    stdin: Option<ChildStdin>,
    child: Child,
}

impl Reaper {
    fn start(dir: &Path, netns: &[String], cgroups: &[PathBuf], keep: bool) -> Result<Self> {
        let words = |v: Vec<String>| -> Result<String> {
            ensure!(v.iter().all(|w| !w.contains(char::is_whitespace)), "a path with white space: {v:?}");
            Ok(v.join(" "))
        };
        let mut cmd = Command::new("sh");
        cmd.args(["-c", REAPER_SCRIPT])
            .env("VIP_REAP_CGROUPS", words(cgroups.iter().map(|c| c.display().to_string()).collect())?)
            .env("VIP_REAP_NETNS", words(netns.to_vec())?)
            .env("VIP_REAP_DIR", words(vec![dir.display().to_string()])?)
            .env("VIP_REAP_KEEP", if keep { "1" } else { "0" })
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        // SAFETY: setsid(2) only: out of the test's process group, so that a ^C
        // (SIGINT to the group) leaves it to clean up.
        unsafe {
            cmd.pre_exec(|| {
                libc::setsid();
                Ok(())
            });
        }
        let mut child = cmd.spawn().context("starting the reaper (sh)")?;
        Ok(Self { stdin: child.stdin.take(), child })
    }

    fn finish(&mut self) {
        self.stdin.take();
        let _ = self.child.wait();
    }
}

impl Drop for Reaper {
    fn drop(&mut self) {
        self.finish();
    }
}

// ---------------------------------------------------------------- nodes

/// A worker node: see the module docs.
pub struct Node {
    pub name: String,
    /// The primary of [`Self::addrs`].
    pub addr: IpAddr,
    /// The node's addresses (its InternalIPs), the primary first.
    pub addrs: Vec<IpAddr>,
    /// The node's network namespace (`eth0` on the segment, `cni0`, the pods' veths).
    pub ns: NetNs,
    dir: PathBuf,
    /// The node's cgroup root (the kubelet's `cgroupRoot`) in every hierarchy.
    cgroups: Vec<PathBuf>,
    /// The node's namespaces as the holder has them: network, UTS, mount.
    nsfs: Vec<File>,
    keeper: Keeper,
    bin: PathBuf,
    daemons: Daemons,
    holder: Daemons,
    pod_cidrs: OnceLock<Vec<String>>,
    proxy_mode: Mutex<ProxyMode>,
    stack: Stack,
}

impl Node {
    /// A command run inside the node's network, UTS and mount namespaces (so it
    /// sees the node's `/run`, `/var/lib`, bpffs and containerd socket).
    pub fn command(&self, program: impl AsRef<std::ffi::OsStr>) -> Command {
        let mut c = Command::new(program);
        let fds = self.nsfs.iter().map(|f| f.try_clone().map(OwnedFd::from)).collect::<std::io::Result<Vec<_>>>().expect("duplicating a namespace fd");
        enter(&mut c, fds);
        c
    }

    /// Runs `args` in the node's namespaces; fails with its output when it fails.
    pub fn exec<S: AsRef<std::ffi::OsStr>>(&self, args: &[S]) -> Result<Output> {
        ensure!(!args.is_empty(), "an empty command");
        run_ok(self.command(&args[0]).args(&args[1..]))
    }

    /// `ctr -n k8s.io ARGS` against the node's containerd.
    pub fn ctr(&self, args: &[&str]) -> Result<Output> {
        let mut a = vec!["ctr", "-n", "k8s.io"];
        a.extend_from_slice(args);
        self.exec(&a)
    }

    /// The node's work directory (configs, logs, and what its `/run`, `/var/lib`
    /// and `/var/log` are).
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The log of `component` (containerd, kubelet, kube-proxy).
    pub fn log(&self, component: &str) -> PathBuf {
        self.dir.join(format!("{component}.log"))
    }

    /// The Node's `spec.podCIDR` (set during bring-up): its primary pod range.
    pub fn pod_cidr(&self) -> &str {
        self.pod_cidrs().first().map(String::as_str).unwrap_or_default()
    }

    /// The Node's `spec.podCIDRs`, the primary first.
    pub fn pod_cidrs(&self) -> &[String] {
        self.pod_cidrs.get().map(Vec::as_slice).unwrap_or_default()
    }

    /// The node's cgroup root in every hierarchy.
    pub fn cgroups(&self) -> &[PathBuf] {
        &self.cgroups
    }

    /// The process id of a running component (containerd, kubelet, kube-proxy).
    pub fn pid(&self, component: &str) -> Option<u32> {
        self.daemons.pid(component)
    }

    pub fn proxy_mode(&self) -> ProxyMode {
        *self.proxy_mode.lock().unwrap()
    }

    /// Stops the kubelet (SIGTERM; SIGKILL after 10 s). Its pods keep running, as
    /// when a real kubelet stops; the Node goes NotReady after the grace period.
    pub fn stop_kubelet(&self) -> bool {
        self.daemons.stop("kubelet", Duration::from_secs(10))
    }

    /// Starts the kubelet again (after [`Self::stop_kubelet`]); does not wait for Ready.
    pub fn start_kubelet(&self) -> Result<()> {
        let args = [
            format!("--config={}", self.dir.join("kubelet.yaml").display()),
            format!("--kubeconfig={}", self.dir.join("kubelet.kubeconfig").display()),
            format!("--node-ip={}", self.addrs.iter().map(IpAddr::to_string).collect::<Vec<_>>().join(",")),
            format!("--hostname-override={}", self.name),
            "--v=2".into(),
        ];
        self.spawn("kubelet", self.bin.join("kubelet"), &args)
    }

    /// Stops kube-proxy (SIGTERM; its rules stay, as with a real kube-proxy).
    pub fn stop_proxy(&self) -> bool {
        self.daemons.stop("kube-proxy", Duration::from_secs(10))
    }

    /// Starts kube-proxy in `mode` and waits until its `/healthz` answers 200 and it
    /// has written its rules once (`/healthz` answers 200 from the start, before).
    pub fn start_proxy(&self, mode: ProxyMode) -> Result<Duration> {
        let cfg = json!({
            "apiVersion": "kubeproxy.config.k8s.io/v1alpha1", "kind": "KubeProxyConfiguration",
            "mode": mode.as_str(),
            "clientConnection": { "kubeconfig": self.dir.parent().unwrap().join("kube-proxy.kubeconfig") },
            "hostnameOverride": self.name,
            "clusterCIDR": cluster_cidrs(self.stack).join(","),
            // kube-proxy's default: the wildcard of the primary family.
            "healthzBindAddress": if self.addr.is_ipv6() { format!("[::]:{PROXY_HEALTHZ_PORT}") } else { format!("0.0.0.0:{PROXY_HEALTHZ_PORT}") },
            "metricsBindAddress": format!("127.0.0.1:{PROXY_METRICS_PORT}"),
            // 0: no machine-wide conntrack sysctl written.
            "conntrack": { "maxPerCore": 0, "min": 0, "tcpEstablishedTimeout": "0s", "tcpCloseWaitTimeout": "0s" },
        });
        write_atomic(&self.dir.join("kube-proxy.yaml"), &serde_json::to_string_pretty(&cfg)?)?;
        *self.proxy_mode.lock().unwrap() = mode;
        let t0 = Instant::now();
        self.spawn("kube-proxy", self.bin.join("kube-proxy"), &[format!("--config={}", self.dir.join("kube-proxy.yaml").display()), "--v=2".into()])?;
        let healthz = SocketAddr::from((self.addr, PROXY_HEALTHZ_PORT));
        let metrics = SocketAddr::from((Ipv4Addr::LOCALHOST, PROXY_METRICS_PORT));
        poll(&format!("kube-proxy ({}) healthy and synced on {}", mode.as_str(), self.name), Duration::from_secs(30), Duration::from_millis(50), || {
            self.daemons.check(|n| self.log(n))?;
            if !matches!(http_get(&self.ns, healthz, "/healthz"), Ok((200, _))) {
                return Ok(None);
            }
            let (_, m) = http_get(&self.ns, metrics, "/metrics")?;
            // A full sync of every family's rules done (the same metric in both modes).
            let synced = self.stack.families().iter().all(|f| {
                let prefix = format!(r#"kubeproxy_sync_full_proxy_rules_duration_seconds_count{{ip_family="{f}"}} "#);
                m.lines().any(|l| l.strip_prefix(&prefix).and_then(|v| v.trim().parse::<f64>().ok()).is_some_and(|n| n >= 1.0))
            });
            Ok(synced.then_some(()))
        })
        .map_err(|e| anyhow!("{e:#}\n{}", log_tail(&self.log("kube-proxy"), 30)))?;
        Ok(t0.elapsed())
    }

    /// Whether the kube-proxy rules of `mode` are in the node's firewall.
    pub fn has_proxy_rules(&self, mode: ProxyMode) -> Result<bool> {
        Ok(match mode {
            ProxyMode::Nftables => stdout(&self.exec(&["nft", "list", "tables"])?).lines().any(|l| l.trim_end().ends_with(" kube-proxy")),
            ProxyMode::Iptables => {
                let v4 = stdout(&self.exec(&["iptables-save"])?);
                let v6 = stdout(&self.exec(&["ip6tables-save"])?);
                (v4 + &v6).lines().any(|l| l.starts_with(":KUBE-SERVICES") || l.starts_with(":KUBE-PROXY-CANARY"))
            }
        })
    }

    /// Spawns a component in the node's namespaces and cgroups, logging to its file.
    fn spawn(&self, name: &'static str, program: PathBuf, args: &[String]) -> Result<()> {
        let (out, err) = append_log(&self.log(name))?;
        let mut cmd = self.command(&program);
        cmd.args(args).stdin(Stdio::null()).stdout(out).stderr(err);
        let system: Vec<PathBuf> = self.cgroups.iter().map(|c| c.join("system")).collect();
        join_cgroups(&mut cmd, &system)?;
        let child = self.keeper.spawn(cmd).with_context(|| format!("{name} on {}", self.name))?;
        self.daemons.insert(name, child);
        Ok(())
    }

    /// The node up to a running containerd with the images imported: namespaces,
    /// mounts, cgroups, containerd.
    fn prepare(i: usize, ns: NetNs, root: &Path, cgroups: Vec<PathBuf>, keeper: Keeper, bin: PathBuf, spec: &ClusterSpec) -> Result<Self> {
        let name = node_name(i);
        let dir = root.join(&name);
        for d in ["run", "var-lib", "var-log", "sysctl", "cni", "opt", "volume-plugins"] {
            std::fs::create_dir_all(dir.join(d))?;
        }
        for c in &cgroups {
            make_cgroup(c)?;
            make_cgroup(&c.join("system"))?;
        }
        // The holder: in the node's network namespace, with a mount and UTS namespace
        // of its own (mounts private: nothing propagates back to the machine).
        let mut cmd = Command::new("sleep");
        cmd.arg("infinity").stdin(Stdio::null()).stdout(Stdio::null()).stderr(Stdio::null());
        enter(&mut cmd, vec![File::open(ns.path()).with_context(|| ns.path().display().to_string())?.into()]);
        let host = CString::new(name.clone())?;
        // SAFETY: unshare(2), mount(2) and sethostname(2) only, between fork and exec.
        unsafe {
            cmd.pre_exec(move || {
                if libc::unshare(libc::CLONE_NEWNS | libc::CLONE_NEWUTS) != 0
                    || libc::mount(std::ptr::null(), c"/".as_ptr(), std::ptr::null(), libc::MS_REC | libc::MS_PRIVATE, std::ptr::null()) != 0
                    || libc::sethostname(host.as_ptr(), host.as_bytes().len()) != 0
                {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let system: Vec<PathBuf> = cgroups.iter().map(|c| c.join("system")).collect();
        join_cgroups(&mut cmd, &system)?;
        let holder = keeper.spawn(cmd).context("starting the node's holder")?;
        let pid = holder.id();
        let holders = Daemons::default();
        holders.insert("holder", holder);
        let nsfs = ["net", "uts", "mnt"]
            .iter()
            .map(|t| File::open(format!("/proc/{pid}/ns/{t}")).with_context(|| format!("the holder's {t} namespace")))
            .collect::<Result<Vec<_>>>()?;
        let addrs = node_addrs(spec.stack, i);
        let node = Node {
            name,
            addr: addrs[0],
            addrs,
            ns,
            dir,
            cgroups,
            nsfs,
            keeper,
            bin,
            daemons: Daemons::default(),
            holder: holders,
            pod_cidrs: OnceLock::new(),
            proxy_mode: Mutex::new(spec.proxy_mode),
            stack: spec.stack,
        };
        node.mounts()?;
        node.ns.sysctl("net.ipv4.ip_forward", "1")?;
        if spec.stack.has_v6() {
            node.ns.sysctl("net.ipv6.conf.all.forwarding", "1")?;
        }
        // A ClusterIP the node itself dials needs a route before kube-proxy's DNAT
        // (which comes after the route lookup of a local packet): the service range
        // via cp stands in for a default route (cp forwards nothing).
        let cp = cp_addrs(spec.stack);
        for range in service_cidrs(spec.stack) {
            let via = same_family(&cp, range).expect("cp has every family").to_string();
            node.ns.ip(&["route", "add", range, "via", &via, "dev", "eth0"])?;
        }
        node.start_containerd(&spec.sandbox_image)?;
        node.import_images(&spec.images, &spec.sandbox_image)?;
        Ok(node)
    }

    fn mounts(&self) -> Result<()> {
        let d = |s: &str| self.dir.join(s).display().to_string();
        self.exec(&["mount", "-t", "bpf", "bpf", "/sys/fs/bpf"])?;
        for (file, value) in [("vm/overcommit_memory", "1"), ("kernel/panic", "10"), ("kernel/panic_on_oops", "1")] {
            let fake = self.dir.join("sysctl").join(file.replace('/', "."));
            std::fs::write(&fake, format!("{value}\n"))?;
            let target = format!("/proc/sys/{file}");
            self.exec(&[OsStr::new("mount"), OsStr::new("--bind"), fake.as_os_str(), OsStr::new(&target)])?;
            self.exec(&["mount", "-o", "remount,bind,ro", &target])?;
        }
        for (src, target) in [("run", "/run"), ("var-lib", "/var/lib"), ("var-log", "/var/log")] {
            self.exec(&["mount", "--bind", &d(src), target])?;
        }
        Ok(())
    }

    fn start_containerd(&self, sandbox_image: &str) -> Result<()> {
        // root and state stay at their defaults, /var/lib/containerd and
        // /run/containerd: the node's own.
        let config = format!(
            r#"version = 2
disabled_plugins = ["io.containerd.snapshotter.v1.btrfs", "io.containerd.snapshotter.v1.zfs", "io.containerd.snapshotter.v1.devmapper", "io.containerd.snapshotter.v1.aufs"]
[plugins."io.containerd.internal.v1.opt"]
  path = "{opt}"
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "{sandbox_image}"
  enable_selinux = false
  restrict_oom_score_adj = true
  netns_mounts_under_state_dir = true
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        SystemdCgroup = false
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "{CNI_BIN_DIR}"
    conf_dir = "{cni}"
"#,
            opt = self.dir.join("opt").display(),
            cni = self.dir.join("cni").display(),
        );
        std::fs::write(self.dir.join("containerd.toml"), config)?;
        self.spawn("containerd", "containerd".into(), &[format!("--config={}", self.dir.join("containerd.toml").display())])?;
        let sock = self.dir.join("run/containerd/containerd.sock");
        poll(&format!("containerd on {}", self.name), Duration::from_secs(20), Duration::from_millis(50), || {
            self.daemons.check(|n| self.log(n))?;
            Ok(std::os::unix::net::UnixStream::connect(&sock).is_ok().then_some(()))
        })
    }

    fn import_images(&self, images: &[PathBuf], sandbox_image: &str) -> Result<()> {
        for img in images {
            let o = self.ctr(&["images", "import", &img.display().to_string()]).with_context(|| format!("importing {} on {}", img.display(), self.name))?;
            // ctr names each image it imports: "unpacking NAME (sha256:…)...done".
            ensure!(
                stdout(&o).lines().any(|l| l.starts_with("unpacking ")),
                "{}: no named image in it (it must carry io.containerd.image.name or a full org.opencontainers.image.ref.name): {}",
                img.display(),
                stdout(&o)
            );
        }
        let names = stdout(&self.ctr(&["images", "ls", "-q"])?);
        ensure!(names.lines().any(|l| l == sandbox_image), "the sandbox image {sandbox_image} is in none of the images; imported: {names}");
        Ok(())
    }

    fn write_kubelet_config(&self, cp_dir: &Path) -> Result<()> {
        let dns = self.stack.pick(IpAddr::from(CLUSTER_DNS), CLUSTER_DNS6.into())[0];
        std::fs::write(self.dir.join("resolv.conf"), format!("nameserver {dns}\n"))?;
        let cfg = json!({
            "apiVersion": "kubelet.config.k8s.io/v1beta1", "kind": "KubeletConfiguration",
            // cgroup v1 (hybrid) host, no systemd, one cgroup root per node.
            "failCgroupV1": false,
            "cgroupDriver": "cgroupfs",
            "cgroupRoot": format!("/{}", self.cgroups[0].file_name().unwrap().to_string_lossy()),
            "containerRuntimeEndpoint": "unix:///run/containerd/containerd.sock",
            "authentication": { "anonymous": { "enabled": false }, "webhook": { "enabled": true }, "x509": { "clientCAFile": cp_dir.join("ca.crt") } },
            "authorization": { "mode": "Webhook" },
            "clusterDNS": [dns.to_string()],
            "clusterDomain": "cluster.local",
            "resolvConf": self.dir.join("resolv.conf"),
            "volumePluginDir": self.dir.join("volume-plugins"),
            "failSwapOn": false,
            // The 3 machine-wide sysctls are faked read-only (module docs).
            "protectKernelDefaults": false,
            "serializeImagePulls": false,
            // Local images only: never collected.
            "imageGCHighThresholdPercent": 100,
            "evictionHard": { "memory.available": "100Mi", "nodefs.available": "1%", "imagefs.available": "1%" },
            // Node lifecycle: see the module docs.
            "nodeStatusUpdateFrequency": "3s",
            "nodeLeaseDurationSeconds": 10,
            "syncFrequency": "10s",
        });
        std::fs::write(self.dir.join("kubelet.yaml"), serde_json::to_string_pretty(&cfg)?)?;
        Ok(())
    }

    /// The CNI config for the node's pod CIDRs: bridge `cni0` (the pods' gateway,
    /// hairpin for a Service's own pods) with host-local addresses, one range set
    /// and one default route per family (a pod gets an address of each).
    fn write_cni(&self, pod_cidrs: &[String]) -> Result<()> {
        let ranges: Vec<Value> = pod_cidrs.iter().map(|c| json!([{ "subnet": c }])).collect();
        let routes: Vec<Value> = pod_cidrs.iter().map(|c| json!({ "dst": if c.contains(':') { "::/0" } else { "0.0.0.0/0" } })).collect();
        let conf = json!({
            "cniVersion": "1.0.0", "name": "vip-cluster",
            "plugins": [{
                "type": "bridge", "bridge": "cni0", "isGateway": true, "ipMasq": false, "hairpinMode": true,
                "ipam": { "type": "host-local", "ranges": ranges, "routes": routes }
            }]
        });
        write_atomic(&self.dir.join("cni/10-vip-cluster.conflist"), &serde_json::to_string_pretty(&conf)?)?;
        let _ = self.pod_cidrs.set(pod_cidrs.to_vec());
        Ok(())
    }

    fn kill(&self) {
        self.daemons.kill_all();
        self.holder.kill_all();
    }
}

// ---------------------------------------------------------------- the cluster

/// How long bring-up took, step by step (from [`Cluster::start`]'s call).
#[derive(Clone, Debug, Default)]
pub struct BringUp {
    /// Namespaces and the bridge made.
    pub network: Duration,
    /// etcd + API server ready.
    pub api_ready: Duration,
    /// Every node's containerd up with the images imported.
    pub nodes_prepared: Duration,
    /// Every Node has its pod CIDR (controller manager) and the CNI config.
    pub pod_cidrs: Duration,
    /// Every Node Ready.
    pub nodes_ready: Duration,
    /// Every kube-proxy healthy: the cluster is up.
    pub total: Duration,
}

/// Machine paths that a node's components would use or create if they escaped
/// their private mounts or configured directories.
const HOST_PATHS: [&str; 12] = [
    "/run/containerd",
    "/run/vip",
    "/var/lib/containerd",
    "/var/lib/kubelet",
    "/var/lib/cni",
    "/var/log/containers",
    "/var/log/pods",
    "/opt/containerd",
    "/opt/cni",
    "/etc/cni/net.d",
    "/etc/kubernetes",
    "/usr/libexec/kubernetes",
];

/// The machine-wide sysctls the kubelet wants changed (faked for it in the nodes).
const GUARDED_SYSCTLS: [&str; 3] = ["vm/overcommit_memory", "kernel/panic", "kernel/panic_on_oops"];

/// Names of everything a cluster makes outside its work directory, and the state
/// of the machine before it started, to check after teardown that nothing is left
/// and nothing changed ([`Footprint::leftovers`]).
#[derive(Clone, Debug)]
pub struct Footprint {
    pub dir: PathBuf,
    pub netns: Vec<String>,
    pub cgroups: Vec<PathBuf>,
    /// [`HOST_PATHS`] that existed before.
    pub host_paths: Vec<String>,
    /// [`GUARDED_SYSCTLS`] with their values before.
    pub sysctls: Vec<(String, String)>,
}

fn existing_host_paths() -> Vec<String> {
    HOST_PATHS.iter().filter(|p| Path::new(p).exists()).map(|p| p.to_string()).collect()
}

fn guarded_sysctls() -> Vec<(String, String)> {
    GUARDED_SYSCTLS.iter().map(|k| (k.to_string(), std::fs::read_to_string(format!("/proc/sys/{k}")).unwrap_or_default().trim().to_owned())).collect()
}

impl Footprint {
    /// What is still there or changed: network namespaces, cgroups, the work
    /// directory (unless kept), processes naming it, Kubernetes rules in the root
    /// namespace's firewall, machine paths that appeared ([`HOST_PATHS`]), the
    /// kubelet's sysctls.
    pub fn leftovers(&self) -> Vec<String> {
        let mut out = Vec::new();
        for p in existing_host_paths() {
            if !self.host_paths.contains(&p) {
                out.push(format!("{p} appeared on the machine"));
            }
        }
        for (now, before) in guarded_sysctls().iter().zip(&self.sysctls) {
            if now != before {
                out.push(format!("sysctl {} changed: {} -> {}", before.0, before.1, now.1));
            }
        }
        for n in &self.netns {
            if Path::new("/run/netns").join(n).exists() {
                out.push(format!("network namespace {n}"));
            }
        }
        for c in &self.cgroups {
            if c.exists() {
                out.push(format!("cgroup {}", c.display()));
            }
        }
        if self.dir.exists() && std::env::var("VIP_KEEP_CLUSTER").as_deref() != Ok("1") {
            out.push(format!("directory {}", self.dir.display()));
        }
        let needle = self.dir.display().to_string();
        for e in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
            let Ok(pid) = e.file_name().to_string_lossy().parse::<u32>() else { continue };
            let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
            let cmdline = String::from_utf8_lossy(&cmdline).replace('\0', " ");
            if cmdline.contains(&needle) {
                out.push(format!("process {pid}: {cmdline}"));
            }
        }
        for (tool, args) in [("iptables-save", &[][..]), ("ip6tables-save", &[][..]), ("nft", &["list", "ruleset"][..])] {
            if let Ok(o) = Command::new(tool).args(args).output() {
                let s = stdout(&o);
                if s.contains("KUBE-") || s.contains("kube-proxy") {
                    out.push(format!("{tool} in the root namespace: Kubernetes rules"));
                }
            }
        }
        out
    }
}

/// A running cluster; see the module docs. Torn down on Drop.
pub struct Cluster {
    // Field order is drop order: processes first, the reaper last.
    nodes: Vec<Node>,
    cp_daemons: Daemons,
    api: RealApiServer,
    client: NetNs,
    cp: NetNs,
    segment: Segment,
    keeper: Keeper,
    spec: ClusterSpec,
    dir: PathBuf,
    footprint: Footprint,
    bring_up: BringUp,
    reaper: Mutex<Option<Reaper>>,
}

impl Cluster {
    /// Brings a cluster up (see the module docs) and waits until every Node is
    /// Ready and every kube-proxy healthy. Check [`available`] first.
    pub fn start(spec: ClusterSpec) -> Result<Self> {
        let t0 = Instant::now();
        ensure!((1..=80).contains(&spec.nodes), "ClusterSpec::nodes: {} (1 to 80)", spec.nodes);
        ensure!(!spec.sandbox_image.is_empty(), "ClusterSpec::sandbox_image: empty");
        for img in &spec.images {
            ensure!(img.is_file(), "ClusterSpec::images: no file {}", img.display());
        }
        let kube_bin = kubeapi::assets().context("KUBEBUILDER_ASSETS is not set")?;
        let node_bin = node_assets().with_context(|| format!("{NODE_ASSETS_ENV} is not set"))?;
        check_host_tools()?;
        let keep = std::env::var("VIP_KEEP_CLUSTER").as_deref() == Ok("1");

        let id = netns::unique("vipc");
        let dir = std::env::temp_dir().join(&id);
        for p in ["/run", "/var/lib", "/var/log", "/sys", "/proc"] {
            ensure!(!dir.starts_with(p), "the work directory {} must not be under {p} (TMPDIR)", dir.display());
        }
        let hierarchies = cgroup_hierarchies()?;
        let node_cgroups: Vec<Vec<PathBuf>> = (0..spec.nodes).map(|i| hierarchies.iter().map(|h| h.join(format!("{id}-{}", node_name(i)))).collect()).collect();
        let ns_names: Vec<String> =
            ["br", "cp", "cl"].iter().map(|s| s.to_string()).chain((1..=spec.nodes).map(|i| format!("n{i}"))).map(|s| format!("{id}-{s}")).collect();
        let footprint = Footprint {
            dir: dir.clone(),
            netns: ns_names.clone(),
            cgroups: node_cgroups.concat(),
            host_paths: existing_host_paths(),
            sysctls: guarded_sysctls(),
        };
        // First, so that whatever fails below is cleaned up.
        let reaper = Reaper::start(&dir, &ns_names, &footprint.cgroups, keep)?;
        std::fs::create_dir_all(dir.join("control-plane"))?;
        eprintln!(
            "cluster: {} node(s), {}, kube-proxy {}, work directory {}{}",
            spec.nodes,
            spec.stack.families().join(" + "),
            spec.proxy_mode.as_str(),
            dir.display(),
            if keep { " (kept)" } else { "" }
        );

        let keeper = Keeper::new("vip-cluster-keeper")?;
        let segment = Segment::in_ns(NetNs::create(ns_names[0].clone())?)?;
        let plug = |name: &str, addrs: &[IpAddr]| -> Result<NetNs> {
            let ns = segment.plug(NetNs::create(name.to_owned())?, &on_segment(addrs[0]))?;
            for a in &addrs[1..] {
                ns.ip(&["addr", "add", &on_segment(*a), "dev", "eth0", "nodad"])?;
            }
            Ok(ns)
        };
        let cp = plug(&ns_names[1], &cp_addrs(spec.stack))?;
        let client = plug(&ns_names[2], &client_addrs(spec.stack))?;
        let node_ns: Vec<NetNs> = (0..spec.nodes).map(|i| plug(&ns_names[3 + i], &node_addrs(spec.stack, i))).collect::<Result<_>>()?;
        let mut bring_up = BringUp { network: t0.elapsed(), ..Default::default() };

        // The API server and the nodes' containerd come up side by side.
        let cp_dir = dir.join("control-plane");
        let opts = Options {
            host: cp_addrs(spec.stack)[0],
            netns: Some(cp.path()),
            port: Some(API_PORT),
            service_cidr: service_cidrs(spec.stack).join(","),
            endpoint_reconciler: true,
            extra_args: vec![
                // logs/exec/port-forward: the API server dials kubelets as admin, at their InternalIP.
                "--kubelet-client-certificate={dir}/admin.crt".into(),
                "--kubelet-client-key={dir}/admin.key".into(),
                "--kubelet-preferred-address-types=InternalIP,Hostname".into(),
            ],
            dir: Some(cp_dir.clone()),
        };
        let (api, nodes) = std::thread::scope(|s| {
            let api = s.spawn(|| {
                let r = RealApiServer::launch(kube_bin, opts);
                (r, t0.elapsed())
            });
            let nodes: Vec<_> = node_ns
                .into_iter()
                .zip(node_cgroups)
                .enumerate()
                .map(|(i, (ns, cg))| {
                    let (keeper, bin, dir, spec) = (keeper.clone(), node_bin.clone(), &dir, &spec);
                    s.spawn(move || Node::prepare(i, ns, dir, cg, keeper, bin, spec).with_context(|| format!("preparing {}", node_name(i))))
                })
                .collect();
            let nodes: Vec<Result<Node>> = nodes.into_iter().map(|h| h.join().unwrap_or_else(|e| std::panic::resume_unwind(e))).collect();
            (api.join().unwrap_or_else(|e| std::panic::resume_unwind(e)), nodes)
        });
        bring_up.nodes_prepared = t0.elapsed();
        let (api, api_at) = api;
        // Nodes that did come up are dropped (killed) on an error below.
        let nodes: Vec<Node> = nodes.into_iter().collect::<Result<_>>()?;
        let api = api.context("the control plane's API server")?;
        bring_up.api_ready = api_at;

        let mut cluster = Cluster {
            nodes,
            cp_daemons: Daemons::default(),
            api,
            client,
            cp,
            segment,
            keeper,
            spec,
            dir,
            footprint,
            bring_up,
            reaper: Mutex::new(Some(reaper)),
        };
        if let Err(e) = cluster.finish_start(t0) {
            let diag = cluster.diagnose();
            return Err(e.context(diag));
        }
        let b = &cluster.bring_up;
        eprintln!(
            "cluster: up in {:.1} s (network {:.1} s, API server ready {:.1} s, containerd + images {:.1} s, pod CIDRs {:.1} s, Nodes Ready {:.1} s, kube-proxy healthy {:.1} s)",
            b.total.as_secs_f64(),
            b.network.as_secs_f64(),
            b.api_ready.as_secs_f64(),
            b.nodes_prepared.as_secs_f64(),
            b.pod_cidrs.as_secs_f64(),
            b.nodes_ready.as_secs_f64(),
            b.total.as_secs_f64()
        );
        Ok(cluster)
    }

    /// From a ready API server and prepared nodes to a ready cluster.
    fn finish_start(&mut self, t0: Instant) -> Result<()> {
        let cp_dir = self.api.dir().to_owned();
        let ca = self.api.ca();
        let kubeconfig = |file: &str, cn: &str, orgs: &[&str]| -> Result<PathBuf> {
            let (cert, key) = ca.client(cn, orgs)?;
            let path = self.dir.join(file);
            std::fs::write(&path, self.api.kubeconfig_for(&cert, &key, "default"))?;
            Ok(path)
        };
        let (admin_cert, admin_key) = (std::fs::read_to_string(cp_dir.join("admin.crt"))?, std::fs::read_to_string(cp_dir.join("admin.key"))?);
        std::fs::write(self.admin_kubeconfig(), self.api.kubeconfig_for(&admin_cert, &admin_key, "default"))?;
        let kcm = kubeconfig("kube-controller-manager.kubeconfig", "system:kube-controller-manager", &[])?;
        let sched = kubeconfig("kube-scheduler.kubeconfig", "system:kube-scheduler", &[])?;
        kubeconfig("kube-proxy.kubeconfig", "system:kube-proxy", &[])?;
        for n in &self.nodes {
            // The Node authorizer and NodeRestriction know a kubelet by these names.
            let path = kubeconfig(&format!("{}/kubelet.kubeconfig", n.name), &format!("system:node:{}", n.name), &["system:nodes"])?;
            debug_assert_eq!(path, n.dir.join("kubelet.kubeconfig"));
            n.write_kubelet_config(&cp_dir)?;
        }

        let node_bin = self.nodes[0].bin.clone();
        let auth = |k: &Path| {
            [
                format!("--kubeconfig={}", k.display()),
                format!("--authentication-kubeconfig={}", k.display()),
                format!("--authorization-kubeconfig={}", k.display()),
            ]
        };
        let f = |n: &str| cp_dir.join(n).display().to_string();
        let mut kcm_args: Vec<String> = auth(&kcm).into();
        kcm_args.extend([
            "--bind-address=127.0.0.1".into(),
            "--leader-elect=false".into(),
            "--use-service-account-credentials=true".into(),
            format!("--service-account-private-key-file={}", f("sa.key")),
            format!("--root-ca-file={}", f("ca.crt")),
            format!("--cluster-signing-cert-file={}", f("ca.crt")),
            format!("--cluster-signing-key-file={}", f("ca.key")),
            format!("--service-cluster-ip-range={}", service_cidrs(self.spec.stack).join(",")),
            format!("--cluster-cidr={}", cluster_cidrs(self.spec.stack).join(",")),
            "--allocate-node-cidrs=true".into(),
            // Its flexvolume prober creates this directory (default under /usr/libexec).
            format!("--flex-volume-plugin-dir={}", f("volume-plugins")),
            format!("--node-monitor-period={}s", NODE_MONITOR_PERIOD.as_secs()),
            format!("--node-monitor-grace-period={}s", NODE_MONITOR_GRACE_PERIOD.as_secs()),
            "--v=1".into(),
        ]);
        // A flag only for each family present: the controller manager refuses the
        // other family's on a single-stack cluster.
        kcm_args.extend(self.spec.stack.pick("--node-cidr-mask-size-ipv4=24", "--node-cidr-mask-size-ipv6=64").into_iter().map(String::from));
        self.spawn_cp("kube-controller-manager", node_bin.join("kube-controller-manager"), &kcm_args)?;
        let mut sched_args: Vec<String> = auth(&sched).into();
        sched_args.extend(["--bind-address=127.0.0.1".into(), "--leader-elect=false".into(), "--v=1".into()]);
        self.spawn_cp("kube-scheduler", node_bin.join("kube-scheduler"), &sched_args)?;
        for n in &self.nodes {
            n.start_kubelet()?;
        }

        // Pod CIDRs from the controller manager (one per family): then the CNI
        // config and the routes.
        let families = self.spec.stack.families().len();
        let cidrs: BTreeMap<String, Vec<String>> = poll("every Node with its spec.podCIDRs", Duration::from_secs(90), Duration::from_millis(100), || {
            self.check_daemons()?;
            let nodes = self.get("/api/v1/nodes")?;
            let cidrs: BTreeMap<String, Vec<String>> = nodes["items"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(|n| {
                    let list: Vec<String> = n["spec"]["podCIDRs"].as_array()?.iter().filter_map(|c| Some(c.as_str()?.to_owned())).collect();
                    Some((n["metadata"]["name"].as_str()?.to_owned(), list))
                })
                .collect();
            Ok(self.nodes.iter().all(|n| cidrs.get(&n.name).is_some_and(|c| c.len() == families)).then_some(cidrs))
        })?;
        for n in &self.nodes {
            n.write_cni(&cidrs[&n.name])?;
        }
        // Every pod range via its node's address of the same family.
        let route = |ns: &NetNs, m: &Node| -> Result<()> {
            for c in m.pod_cidrs() {
                let via = same_family(&m.addrs, c).with_context(|| format!("{}: no address of {c}'s family", m.name))?.to_string();
                ns.ip(&["route", "replace", c, "via", &via, "dev", "eth0"])?;
            }
            Ok(())
        };
        for n in &self.nodes {
            for m in self.nodes.iter().filter(|m| m.name != n.name) {
                route(&n.ns, m)?;
            }
            route(&self.cp, n)?;
        }
        self.bring_up.pod_cidrs = t0.elapsed();

        self.wait_nodes_ready(Duration::from_secs(120))?;
        self.bring_up.nodes_ready = t0.elapsed();
        let mode = self.spec.proxy_mode;
        std::thread::scope(|s| {
            let hs: Vec<_> = self.nodes.iter().map(|n| s.spawn(move || n.start_proxy(mode))).collect();
            hs.into_iter().map(|h| h.join().unwrap_or_else(|e| std::panic::resume_unwind(e)).map(|_| ())).collect::<Result<Vec<()>>>()
        })?;
        // Pods need their namespace's ServiceAccount, which the controller manager makes.
        poll("the default ServiceAccount", Duration::from_secs(60), Duration::from_millis(100), || {
            Ok((self.api_get("/api/v1/namespaces/default/serviceaccounts/default")?.status == 200).then_some(()))
        })?;
        self.bring_up.total = t0.elapsed();
        Ok(())
    }

    fn spawn_cp(&self, name: &'static str, program: PathBuf, args: &[String]) -> Result<()> {
        let (out, err) = append_log(&self.api.dir().join(format!("{name}.log")))?;
        let mut cmd = Command::new(program);
        cmd.args(args).stdin(Stdio::null()).stdout(out).stderr(err);
        enter(&mut cmd, vec![File::open(self.cp.path())?.into()]);
        self.cp_daemons.insert(name, self.keeper.spawn(cmd)?);
        Ok(())
    }

    fn check_daemons(&self) -> Result<()> {
        self.cp_daemons.check(|n| self.api.dir().join(format!("{n}.log")))?;
        for n in &self.nodes {
            n.daemons.check(|c| n.log(c)).with_context(|| format!("on {}", n.name))?;
        }
        Ok(())
    }

    /// One cluster for the whole test binary (2 nodes, [`ClusterSpec::default`]),
    /// torn down at exit; `None`: skipped (see [`available`]). Panics if it does not
    /// come up. Tests that change it (kube-proxy mode, kubelets, links) restore it.
    pub fn shared() -> Option<&'static Self> {
        static SHARED: OnceLock<Option<Cluster>> = OnceLock::new();
        extern "C" fn cleanup() {
            if let Some(Some(c)) = SHARED.get() {
                c.teardown();
            }
        }
        SHARED
            .get_or_init(|| {
                let spec = ClusterSpec::default();
                if !available(&spec) {
                    return None;
                }
                let c = Cluster::start(spec).unwrap_or_else(|e| panic!("the cluster did not come up: {e:#}"));
                // SAFETY: registers a plain function.
                unsafe { libc::atexit(cleanup) };
                Some(c)
            })
            .as_ref()
    }

    /// Kills everything and removes what the cluster made (idempotent).
    pub fn teardown(&self) {
        for n in &self.nodes {
            n.kill();
        }
        self.cp_daemons.kill_all();
        self.api.stop();
        if let Some(mut r) = self.reaper.lock().unwrap_or_else(|e| e.into_inner()).take() {
            r.finish();
        }
    }

    pub fn nodes(&self) -> &[Node] {
        &self.nodes
    }

    /// Node `i` (0-based: node-1 is `node(0)`).
    pub fn node(&self, i: usize) -> &Node {
        &self.nodes[i]
    }

    pub fn node_by_name(&self, name: &str) -> Option<&Node> {
        self.nodes.iter().find(|n| n.name == name)
    }

    /// The client's namespace ([`client_addrs`], no routes beyond the segment).
    pub fn client(&self) -> &NetNs {
        &self.client
    }

    /// The control plane's namespace ([`cp_addrs`]).
    pub fn cp(&self) -> &NetNs {
        &self.cp
    }

    /// The segment: [`Segment::isolate`] / [`Segment::cable`] cut a node's link.
    pub fn segment(&self) -> &Segment {
        &self.segment
    }

    /// The API server (its `block_on`/`with_admin` give an admin client in `cp`).
    pub fn api(&self) -> &RealApiServer {
        &self.api
    }

    pub fn spec(&self) -> &ClusterSpec {
        &self.spec
    }

    /// The work directory: configs, PKI, logs, the nodes' state.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    pub fn bring_up(&self) -> &BringUp {
        &self.bring_up
    }

    pub fn footprint(&self) -> &Footprint {
        &self.footprint
    }

    /// The admin kubeconfig (default namespace `default`); its server,
    /// `https://198.18.0.2:6443`, is reachable from the lab's namespaces only.
    pub fn admin_kubeconfig(&self) -> PathBuf {
        self.dir.join("admin.kubeconfig")
    }

    /// The admin kubeconfig with another server URL, e.g. the `kubernetes`
    /// Service's `https://198.18.128.1:443` (the serving certificate names it).
    pub fn admin_kubeconfig_text(&self, url: &str) -> Result<String> {
        let text = std::fs::read_to_string(self.admin_kubeconfig())?;
        let mut v: Value = serde_json::from_str(&text)?;
        v["clusters"][0]["cluster"]["server"] = json!(url);
        Ok(serde_json::to_string_pretty(&v)?)
    }

    fn api_get(&self, path: &str) -> Result<kubeapi::Reply> {
        let path = path.to_owned();
        self.api.block_on(|c| async move { raw(&c, Method::GET, &path, "", None).await })
    }

    /// GET `path` as admin; fails on a non-2xx answer.
    pub fn get(&self, path: &str) -> Result<Value> {
        self.api_get(path)?.ok().with_context(|| format!("GET {path}"))
    }

    /// `kubectl ARGS` as admin (inside `cp`); fails with its stderr when it fails.
    pub fn kubectl<S: AsRef<std::ffi::OsStr>>(&self, args: &[S]) -> Result<Output> {
        run_ok(self.kubectl_command().args(args))
    }

    /// `kubectl ARGS` with `input` on its stdin (`apply -f -`).
    pub fn kubectl_stdin<S: AsRef<std::ffi::OsStr>>(&self, args: &[S], input: &str) -> Result<Output> {
        let mut cmd = self.kubectl_command();
        cmd.args(args).stdin(Stdio::piped()).stdout(Stdio::piped()).stderr(Stdio::piped());
        let mut child = cmd.spawn().context("starting kubectl")?;
        child.stdin.take().unwrap().write_all(input.as_bytes())?;
        let o = child.wait_with_output()?;
        ensure!(
            o.status.success(),
            "kubectl {:?} failed ({}): {}",
            args.iter().map(|a| a.as_ref()).collect::<Vec<_>>(),
            o.status,
            String::from_utf8_lossy(&o.stderr)
        );
        Ok(o)
    }

    /// A `kubectl` command with the admin kubeconfig, inside `cp`.
    pub fn kubectl_command(&self) -> Command {
        let mut c = Command::new(KUBECTL);
        c.arg(format!("--kubeconfig={}", self.admin_kubeconfig().display()));
        enter(&mut c, vec![File::open(self.cp.path()).expect("the cp namespace").into()]);
        c
    }

    /// `kubectl apply -f -` of `yaml`.
    pub fn apply_yaml(&self, yaml: &str) -> Result<()> {
        self.kubectl_stdin(&["apply", "-f", "-"], yaml).map(|_| ())
    }

    /// `kubectl apply -k DIR` (a kustomization).
    pub fn apply_kustomize(&self, dir: &Path) -> Result<()> {
        self.kubectl(&["apply".as_ref(), "-k".as_ref(), dir.as_os_str()]).map(|_| ())
    }

    /// `kubectl rollout status` of `what` (`deployment/web`, `daemonset/vip-agent`)
    /// in `namespace`; on failure the error shows the pods, events and logs.
    pub fn wait_rollout(&self, what: &str, namespace: &str, timeout: Duration) -> Result<()> {
        self.kubectl(&["-n", namespace, "rollout", "status", what, &format!("--timeout={}s", timeout.as_secs().max(1))])
            .map(|_| ())
            .map_err(|e| anyhow!("{what} in {namespace}: {e:#}\n{}", self.diagnose()))
    }

    /// The Ready condition's status of Node `name` ("True", "False", "Unknown").
    pub fn node_ready(&self, name: &str) -> Result<String> {
        let n = self.get(&format!("/api/v1/nodes/{name}"))?;
        Ok(ready_status(&n).unwrap_or("").to_owned())
    }

    /// Waits until Node `name`'s Ready condition is `status`.
    pub fn wait_node_ready_status(&self, name: &str, status: &str, timeout: Duration) -> Result<Duration> {
        let t0 = Instant::now();
        poll(&format!("Node {name} Ready={status}"), timeout, Duration::from_millis(200), || Ok((self.node_ready(name)? == status).then_some(())))
            .map_err(|e| anyhow!("{e:#}\n{}", self.diagnose()))?;
        Ok(t0.elapsed())
    }

    /// Waits until every Node is Ready and without a `node.kubernetes.io/not-ready`
    /// taint for longer than the controller manager's node monitor period: a taint
    /// it queued while a Node was still NotReady may land just after the Node's
    /// Ready, and goes with its next pass.
    pub fn wait_nodes_ready(&self, timeout: Duration) -> Result<()> {
        let mut since: Option<Instant> = None;
        poll("every Node Ready and untainted", timeout, Duration::from_millis(100), || {
            self.check_daemons()?;
            let nodes = self.get("/api/v1/nodes")?;
            let ready: Vec<&str> = nodes["items"]
                .as_array()
                .into_iter()
                .flatten()
                .filter(|n| ready_status(n) == Some("True"))
                .filter(|n| !n["spec"]["taints"].as_array().is_some_and(|ts| ts.iter().any(|t| t["key"] == "node.kubernetes.io/not-ready")))
                .filter_map(|n| n["metadata"]["name"].as_str())
                .collect();
            if !self.nodes.iter().all(|n| ready.contains(&n.name.as_str())) {
                since = None;
                return Ok(None);
            }
            Ok((since.get_or_insert_with(Instant::now).elapsed() > NODE_MONITOR_PERIOD + Duration::from_millis(500)).then_some(()))
        })
    }

    /// Switches kube-proxy on every node to `mode`: stops it, runs
    /// `kube-proxy --cleanup` (which removes the rules of every mode), starts it in
    /// `mode` and waits for its `/healthz`; then checks that the old mode's rules
    /// are gone and the new ones are there.
    pub fn set_proxy_mode(&self, mode: ProxyMode) -> Result<Duration> {
        let t0 = Instant::now();
        for n in &self.nodes {
            let old = n.proxy_mode();
            n.stop_proxy();
            let cfg = n.dir.join("kube-proxy.yaml");
            let o = n.command(n.bin.join("kube-proxy")).arg(format!("--config={}", cfg.display())).arg("--cleanup").output()?;
            std::fs::write(n.dir.join("kube-proxy-cleanup.log"), [&o.stdout[..], &o.stderr[..]].concat())?;
            n.start_proxy(mode).with_context(|| format!("kube-proxy in {} mode on {}", mode.as_str(), n.name))?;
            if old != mode {
                ensure!(
                    !n.has_proxy_rules(old)?,
                    "{}: kube-proxy's {} rules are still there after --cleanup ({}):\n{}",
                    n.name,
                    old.as_str(),
                    o.status,
                    log_tail(&n.dir.join("kube-proxy-cleanup.log"), 20)
                );
            }
            poll(&format!("{} rules of kube-proxy on {}", mode.as_str(), n.name), Duration::from_secs(20), Duration::from_millis(100), || {
                Ok(n.has_proxy_rules(mode)?.then_some(()))
            })?;
        }
        Ok(t0.elapsed())
    }

    /// Resident memory (bytes) of each component: the control plane's, and per
    /// node its daemons and the rest of its cgroups (shims and pods).
    pub fn memory(&self) -> Vec<(String, u64)> {
        let mut out: Vec<(String, u64)> = self.api.pids().into_iter().map(|(n, p)| (n.to_owned(), rss(p))).collect();
        out.extend(self.cp_daemons.pids().into_iter().map(|(n, p)| (n.to_owned(), rss(p))));
        for n in &self.nodes {
            let daemons = n.daemons.pids();
            for (c, p) in &daemons {
                out.push((format!("{}/{c}", n.name), rss(*p)));
            }
            // Any hierarchy lists every process of the node once (the v1 memory one
            // when there is one).
            let tree = n.cgroups.iter().find(|c| c.starts_with("/sys/fs/cgroup/memory")).unwrap_or(&n.cgroups[0]);
            let rest: u64 = cgroup_pids(tree).into_iter().filter(|p| !daemons.iter().any(|(_, d)| d == p)).map(rss).sum();
            out.push((format!("{}/shims+pods+holder", n.name), rest));
        }
        out
    }

    /// What to look at when something failed: Nodes, pods, recent events, and the
    /// tails of every component's log.
    pub fn diagnose(&self) -> String {
        let mut s = String::new();
        for args in [&["get", "nodes", "-o", "wide"][..], &["get", "pods", "-A", "-o", "wide"][..], &["get", "events", "-A", "--sort-by=.lastTimestamp"][..]] {
            match self.kubectl_command().args(args).stdin(Stdio::null()).output() {
                Ok(o) => {
                    let out = stdout(&o);
                    let lines: Vec<&str> = out.lines().collect();
                    s += &format!(
                        "--- kubectl {}\n{}{}\n",
                        args.join(" "),
                        lines[lines.len().saturating_sub(40)..].join("\n"),
                        String::from_utf8_lossy(&o.stderr)
                    );
                }
                Err(e) => s += &format!("--- kubectl {}: {e}\n", args.join(" ")),
            }
        }
        for c in ["kube-apiserver", "kube-controller-manager", "kube-scheduler"] {
            let p = self.api.dir().join(format!("{c}.log"));
            s += &format!("--- {}\n{}\n", p.display(), log_tail(&p, 15));
        }
        for n in &self.nodes {
            for c in ["containerd", "kubelet", "kube-proxy"] {
                s += &format!("--- {}\n{}\n", n.log(c).display(), log_tail(&n.log(c), 15));
            }
        }
        s
    }
}

/// The status of a Node's Ready condition.
fn ready_status(node: &Value) -> Option<&str> {
    node["status"]["conditions"].as_array()?.iter().find(|c| c["type"] == "Ready")?["status"].as_str()
}

impl Drop for Cluster {
    fn drop(&mut self) {
        self.teardown();
    }
}
