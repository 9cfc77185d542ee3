//! The real `vip-agent` binary run inside a lab namespace (killed on Drop), the
//! agent run in-process on a thread in one ([`InProcessAgent`]), and the
//! single-load-balancer lab the agent tests and benchmarks share.
use std::{
    collections::BTreeMap,
    net::{Ipv4Addr, SocketAddr},
    path::{Path, PathBuf},
    process::{Child, Stdio},
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc,
    },
    time::{Duration, Instant},
};

use anyhow::{bail, Context as _, Result};
use clap::Parser as _;
use vip_agent::status::Status;

use crate::{
    lab::{accept_vip, fetch, name_server, xdp_mode_arg, Segment},
    netns::{unique, NetNs, PinDir},
};

/// The agent binary: $VIP_AGENT_BIN, else target/release/vip-agent next to the
/// test executable's deps/ directory (`cargo xtask test` builds it first).
pub fn agent_bin() -> Result<PathBuf> {
    if let Some(p) = std::env::var_os("VIP_AGENT_BIN") {
        return Ok(p.into());
    }
    let exe = std::env::current_exe()?;
    for dir in exe.ancestors().skip(1).take(3) {
        let p = dir.join("vip-agent");
        if p.is_file() {
            return Ok(p);
        }
    }
    bail!("vip-agent binary not found near {}; build it with `cargo build --release -p vip-agent` (cargo xtask test does)", exe.display())
}

/// The previous release's agent binary, as `cargo xtask test` (or `cargo xtask
/// previous-release`) builds it from the commit releases.toml names:
/// $VIP_PREVIOUS_AGENT_BIN, else target/releases/previous/vip-agent; and its
/// version (the `version` file beside it, else "previous").
pub fn previous_release_bin() -> Result<(PathBuf, String)> {
    let bin = match std::env::var_os("VIP_PREVIOUS_AGENT_BIN") {
        Some(p) => PathBuf::from(p),
        None => Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/releases/previous/vip-agent"),
    };
    if !bin.is_file() {
        bail!("the previous release's agent {} is missing: build it with `cargo xtask previous-release` (cargo xtask test does)", bin.display());
    }
    let version = std::fs::read_to_string(bin.with_file_name("version")).map(|v| v.trim().to_owned()).unwrap_or_else(|_| "previous".into());
    Ok((bin, version))
}

pub struct AgentProc {
    pub child: Child,
    pub log: PathBuf,
}

/// What a kubelet gives a pod to reach the API in-cluster: the ServiceAccount's
/// files (`token`, `ca.crt`, `namespace`) at
/// /var/run/secrets/kubernetes.io/serviceaccount and the `kubernetes` Service's
/// address in `KUBERNETES_SERVICE_HOST` / `_PORT`.
#[derive(Clone, Debug)]
pub struct InCluster {
    pub service_account: PathBuf,
    pub service: std::net::SocketAddr,
    /// The API server behind the Service (what kube-proxy sends it to).
    pub endpoint: std::net::SocketAddr,
}

impl InCluster {
    /// What kube-proxy programs on a node for the `kubernetes` Service, for the
    /// node's own (host-network) processes: the Service DNATed to the API server,
    /// in the node's namespace `ns` (a route to the Service address lets the
    /// connect pass the routing that precedes the rewrite; a counter shows use).
    pub fn program_kube_proxy(&self, ns: &NetNs) -> Result<()> {
        let (service, api) = (self.service, self.endpoint);
        let (family, match_daddr, to, host_len) = match (service.ip(), api.ip()) {
            (std::net::IpAddr::V4(s), std::net::IpAddr::V4(a)) => ("ip", format!("ip daddr {s}"), format!("{a}:{}", api.port()), 32),
            (std::net::IpAddr::V6(s), std::net::IpAddr::V6(a)) => ("ip6", format!("ip6 daddr {s}"), format!("[{a}]:{}", api.port()), 128),
            _ => bail!("the kubernetes Service {service} and the API server {api} are of different families"),
        };
        ns.ip(&["route", "add", &format!("{}/{host_len}", service.ip()), "dev", "eth0"])?;
        ns.nft(&["add", "table", family, "kube-proxy"])?;
        ns.nft(&["add", "chain", family, "kube-proxy", "output", "{ type nat hook output priority -100; }"])?;
        let rule = format!("{match_daddr} tcp dport {} counter dnat to {to}", service.port());
        let mut args = vec!["add", "rule", family, "kube-proxy", "output"];
        args.extend(rule.split(' '));
        ns.nft(&args)?;
        Ok(())
    }
}

/// Run by `sh -c` in the agent's own mount namespace, as a container sees its
/// mounts: an empty /run (as a container's; /var/run points there) with the
/// ServiceAccount's directory ($1) bound read-only where client libraries look.
const POD_MOUNTS: &str = "set -e; mount -t tmpfs -o mode=755 pod-run /run; \
    mkdir -p /run/secrets/kubernetes.io/serviceaccount; \
    mount -o bind,ro \"$1\" /run/secrets/kubernetes.io/serviceaccount; shift; exec \"$@\"";

impl AgentProc {
    /// Starts `vip-agent run` in `ns` with `args` after `run`; output goes to `log`.
    pub fn start(ns: &NetNs, args: &[&str], log: &Path) -> Result<Self> {
        Self::spawn(ns, args, log, std::fs::File::create(log)?)
    }

    /// Like `start`, running the agent binary `bin` (this build's, [`agent_bin`], or
    /// another release's) and appending to `log` (a restarted agent keeps its history).
    pub fn start_appending(ns: &NetNs, bin: &Path, args: &[&str], log: &Path) -> Result<Self> {
        Self::spawn_wrapped(ns, bin, &[], args, log, std::fs::OpenOptions::new().create(true).append(true).open(log)?)
    }

    /// Like `start`, with `wrapper` (a program and its arguments, e.g. `setpriv` to
    /// drop capabilities) in front of the agent; it must exec the agent in place.
    pub fn start_wrapped(ns: &NetNs, wrapper: &[&str], args: &[&str], log: &Path) -> Result<Self> {
        Self::spawn_wrapped(ns, &agent_bin()?, wrapper, args, log, std::fs::File::create(log)?)
    }

    /// Like `start_appending`, as a DaemonSet's pod: in a mount namespace of its own
    /// with `pod`'s ServiceAccount files, its environment, and no kubeconfig.
    pub fn start_in_pod(ns: &NetNs, bin: &Path, pod: &InCluster, args: &[&str], log: &Path) -> Result<Self> {
        let sa = pod.service_account.to_str().context("ServiceAccount path")?;
        let wrapper = ["unshare", "--mount", "--propagation", "private", "--", "sh", "-c", POD_MOUNTS, "sh", sa];
        let out = std::fs::OpenOptions::new().create(true).append(true).open(log)?;
        Self::spawn_with(ns, bin, &wrapper, args, log, out, Some(pod))
    }

    fn spawn(ns: &NetNs, args: &[&str], log: &Path, out: std::fs::File) -> Result<Self> {
        Self::spawn_wrapped(ns, &agent_bin()?, &[], args, log, out)
    }

    fn spawn_wrapped(ns: &NetNs, bin: &Path, wrapper: &[&str], args: &[&str], log: &Path, out: std::fs::File) -> Result<Self> {
        Self::spawn_with(ns, bin, wrapper, args, log, out, None)
    }

    fn spawn_with(ns: &NetNs, bin: &Path, wrapper: &[&str], args: &[&str], log: &Path, out: std::fs::File, pod: Option<&InCluster>) -> Result<Self> {
        let bin = bin.to_str().context("agent path")?;
        let mut cmd = match wrapper.split_first() {
            Some((program, rest)) => {
                let mut c = ns.cmd(program);
                c.args(rest).arg(bin);
                c
            }
            None => ns.cmd(bin),
        };
        cmd.arg("run").args(args).env("RUST_LOG", "info");
        if let Some(pod) = pod {
            // A container has no kubeconfig and no home of the host's.
            cmd.env_remove("KUBECONFIG").env("HOME", "/nonexistent");
            cmd.env("KUBERNETES_SERVICE_HOST", pod.service.ip().to_string()).env("KUBERNETES_SERVICE_PORT", pod.service.port().to_string());
        }
        // Agents given no heartbeat key run unsigned, as on a trusted segment (the
        // HA lab gives its agents a key).
        if !args.contains(&"--heartbeat-key-file") {
            cmd.env("VIP_TRUSTED_SEGMENT", "true");
        }
        let child = cmd.stdout(Stdio::from(out.try_clone()?)).stderr(Stdio::from(out)).spawn().context("starting vip-agent")?;
        Ok(Self { child, log: log.to_owned() })
    }

    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Sends `sig` to the agent.
    pub fn signal(&self, sig: i32) {
        // SAFETY: plain kill(2) on our own child's pid.
        unsafe { libc::kill(self.child.id() as i32, sig) };
    }

    /// Fails (with the agent's log) if the agent has exited.
    pub fn check_alive(&mut self) -> Result<()> {
        if let Some(st) = self.child.try_wait()? {
            bail!("vip-agent exited ({st}); log:\n{}", self.log_text());
        }
        Ok(())
    }
}

impl Drop for AgentProc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `vip_agent::agent::run` in this process, on a thread in a lab namespace (the
/// runtime's threads and the liveness thread it starts inherit it), with the
/// arguments `vip-agent run` takes (read by the binary's own parser and
/// `Options::from_args`), stopped by the shutdown future it is given: the
/// agent as a library, as mini-redis's `run(listener, shutdown)` is tested.
/// Its logs go to `log`; the process has one log sink, so one in-process agent
/// logs at a time.
pub struct InProcessAgent {
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<Result<()>>>,
    pub log: PathBuf,
}

/// Where in-process agents' logs go (the process-wide tracing subscriber writes here).
static LOG_SINK: std::sync::Mutex<Option<std::fs::File>> = std::sync::Mutex::new(None);

struct LogSink;

impl std::io::Write for LogSink {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        match LOG_SINK.lock().map_err(|_| std::io::Error::other("log sink poisoned"))?.as_mut() {
            Some(f) => f.write(buf),
            None => Ok(buf.len()),
        }
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl InProcessAgent {
    pub fn start(ns: &NetNs, args: &[&str], log: &Path) -> Result<Self> {
        let mut argv = vec!["vip-agent", "run"];
        argv.extend_from_slice(args);
        if !args.contains(&"--heartbeat-key-file") {
            argv.push("--trusted-segment");
        }
        let cli = vip_agent::cli::Cli::try_parse_from(&argv).context("vip-agent run's arguments")?;
        let vip_agent::cli::Cmd::Run(r) = cli.cmd else { bail!("not `vip-agent run`") };
        let opts = vip_agent::agent::Options::from_args(*r, cli.pin_dir)?;
        *LOG_SINK.lock().map_err(|_| anyhow::anyhow!("log sink poisoned"))? = Some(std::fs::File::create(log)?);
        // Once per process; later agents log through the same sink.
        let _ = tracing_subscriber::fmt().with_writer(|| LogSink).with_ansi(false).with_env_filter("info").try_init();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let thread = ns.spawn(move || -> Result<()> {
            let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
            rt.block_on(vip_agent::agent::run(opts, async {
                let _ = stopped.await;
            }))
        })?;
        Ok(Self { stop: Some(stop), thread: Some(thread), log: log.to_owned() })
    }

    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Completes the agent's shutdown future and waits for `run` to return its result.
    pub fn stop(&mut self) -> Result<()> {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        match self.thread.take() {
            Some(t) => t.join().map_err(|_| anyhow::anyhow!("the agent's thread panicked"))?,
            None => Ok(()),
        }
    }

    /// Fails (with the log) if `run` has returned.
    pub fn check_alive(&mut self) -> Result<()> {
        if self.thread.as_ref().is_some_and(|t| t.is_finished()) {
            let ended = self.stop();
            bail!("the in-process agent returned ({ended:?}); log:\n{}", self.log_text());
        }
        Ok(())
    }
}

impl Drop for InProcessAgent {
    fn drop(&mut self) {
        let _ = self.stop();
    }
}

/// How a lab runs its agent.
pub enum LabAgent {
    Process(AgentProc),
    InProcess(InProcessAgent),
}

impl LabAgent {
    pub fn log_text(&self) -> String {
        match self {
            LabAgent::Process(a) => a.log_text(),
            LabAgent::InProcess(a) => a.log_text(),
        }
    }

    pub fn check_alive(&mut self) -> Result<()> {
        match self {
            LabAgent::Process(a) => a.check_alive(),
            LabAgent::InProcess(a) => a.check_alive(),
        }
    }

    fn exited(&mut self) -> bool {
        match self {
            LabAgent::Process(a) => a.child.try_wait().ok().flatten().is_some(),
            LabAgent::InProcess(a) => a.thread.as_ref().is_none_or(|t| t.is_finished()),
        }
    }
}

/// Polls `f` every 5 ms until it returns Some or `limit` passes.
pub fn wait_for<T>(limit: Duration, mut f: impl FnMut() -> Option<T>) -> Option<T> {
    let end = Instant::now() + limit;
    loop {
        if let Some(v) = f() {
            return Some(v);
        }
        if Instant::now() >= end {
            return None;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Writes through a temporary file and a rename: the agent never reads half a file.
pub fn write_atomic(path: &Path, text: &str) -> Result<()> {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, text)?;
    std::fs::rename(&tmp, path)?;
    Ok(())
}

/// A temporary directory, removed on Drop.
pub struct TempDir(pub PathBuf);

impl TempDir {
    pub fn new(prefix: &str) -> Result<Self> {
        let p = std::env::temp_dir().join(unique(prefix));
        std::fs::create_dir_all(&p)?;
        Ok(Self(p))
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A backend namespace serving its name on port 80 (stoppable, restartable).
pub struct Backend {
    pub ns: NetNs,
    pub name: String,
    stop: Arc<AtomicBool>,
}

impl Backend {
    pub fn serve(&mut self) -> Result<()> {
        self.stop = Arc::new(AtomicBool::new(false));
        name_server(&self.ns, 80, self.name.clone(), self.stop.clone())?;
        Ok(())
    }

    /// Stops answering: the listener closes within a few ms (connections are refused).
    pub fn halt(&self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

impl Drop for Backend {
    fn drop(&mut self) {
        self.halt();
    }
}

pub const LB_VIP: Ipv4Addr = Ipv4Addr::new(198, 18, 1, 10);
pub const LB_CLIENT: Ipv4Addr = Ipv4Addr::new(198, 18, 0, 100);

/// Health check settings of the single-load-balancer lab's service.
#[derive(Clone, Copy)]
pub struct Check {
    pub interval_ms: u64,
    pub timeout_ms: u64,
    pub rise: u32,
    pub fall: u32,
}

/// Config of the single-load-balancer lab: node `lb` holds VIP 198.18.1.10 and
/// balances service `web` (TCP `ports`) over backends b1..bN, TCP-checked on 80.
/// `extra_node_key` is appended to lb's entry (to make a file invalid).
pub fn lb_config(backends: usize, ports: &str, c: Check, extra_node_key: &str) -> String {
    let mut nodes = String::new();
    for i in 1..=backends {
        nodes.push_str(&format!("  - {{name: b{i}, address: 198.18.0.{}, labels: {{role: backend}}}}\n", 10 + i));
    }
    let lines = [
        format!("# lab: one load balancer node, {backends} backends"),
        "nodes:".into(),
        format!("  - name: lb\n    address: 198.18.0.1\n    labels: {{role: lb}}{extra_node_key}"),
        nodes.trim_end().into(),
        "pools:".into(),
        format!("  - name: lab\n    addresses: [{LB_VIP}]\n    nodeSelector: {{role: lb}}"),
        "services:".into(),
        format!("  - name: web\n    vip: {LB_VIP}\n    ports: [{ports}]\n    tableSize: 251\n    backendSelector: {{role: backend}}"),
        format!("    healthCheck: {{type: tcp, port: 80, interval: {}ms, timeout: {}ms, rise: {}, fall: {}}}", c.interval_ms, c.timeout_ms, c.rise, c.fall),
        "announce:\n  holdTime: 200ms\n".into(),
    ];
    lines.join("\n")
}

/// One load-balancer node running the real agent, N backends with the VIP on lo
/// (L2 direct server return), a client; all on one bridge. Removed on Drop.
pub struct LbLab {
    // Field order is drop order: the agent goes first, the namespaces last.
    pub agent: LabAgent,
    pub pins: PinDir,
    pub backends: Vec<Backend>,
    pub client: NetNs,
    pub lb: NetNs,
    pub seg: Segment,
    pub config: PathBuf,
    pub status_file: PathBuf,
    pub tmp: TempDir,
}

impl LbLab {
    /// The lab with the agent binary as a process.
    pub fn start(backends: usize, config_text: &str, metrics_port: u16) -> Result<Self> {
        Self::start_with(backends, config_text, metrics_port, false)
    }

    /// `in_process`: the agent runs in this process ([`InProcessAgent`]).
    pub fn start_with(backends: usize, config_text: &str, metrics_port: u16, in_process: bool) -> Result<Self> {
        let tmp = TempDir::new("vip-lb-lab-")?;
        let (config, status_file, log) = (tmp.0.join("vip.yaml"), tmp.0.join("status.json"), tmp.0.join("agent.log"));
        write_atomic(&config, config_text)?;
        let seg = Segment::new()?;
        let lb = seg.host("vlb", "198.18.0.1/24")?;
        let client = seg.host("vcl", &format!("{LB_CLIENT}/24"))?;
        // VIPs are on-link for the client: it ARPs for them on the segment.
        client.ip(&["route", "add", "198.18.1.0/24", "dev", "eth0"])?;
        let mut bs = Vec::new();
        for i in 1..=backends {
            let ns = seg.host(&format!("vb{i}"), &format!("198.18.0.{}/24", 10 + i))?;
            accept_vip(&ns, LB_VIP)?;
            let mut b = Backend { ns, name: format!("b{i}"), stop: Arc::new(AtomicBool::new(true)) };
            b.serve()?;
            bs.push(b);
        }
        let pins = PinDir::new()?;
        let metrics = format!("127.0.0.1:{metrics_port}");
        let args = [
            "--config",
            path_str(&config)?,
            "--node-name",
            "lb",
            "--iface",
            "eth0",
            "--mode",
            xdp_mode_arg(),
            "--pin-dir",
            path_str(&pins.path)?,
            "--status-file",
            path_str(&status_file)?,
            "--reload-interval",
            "100ms",
            "--metrics-addr",
            &metrics,
        ];
        let agent =
            if in_process { LabAgent::InProcess(InProcessAgent::start(&lb, &args, &log)?) } else { LabAgent::Process(AgentProc::start(&lb, &args, &log)?) };
        Ok(Self { agent, pins, backends: bs, client, lb, seg, config, status_file, tmp })
    }

    /// The agent's status (its own type, read from its status file).
    pub fn status(&self) -> Option<Status> {
        serde_json::from_str(&std::fs::read_to_string(&self.status_file).ok()?).ok()
    }

    /// (healthy, in the ring of service `web`) of backend `node` in the agent's status.
    pub fn backend_state(&self, node: &str) -> Option<(bool, bool)> {
        let s = self.status()?;
        let healthy = s.health.iter().find(|h| h.node == node)?.healthy;
        let in_ring = s.services.iter().find(|v| v.name == "web")?.backends.iter().any(|b| b == node);
        Some((healthy, in_ring))
    }

    /// Waits until the VIP is held and all backends are in the ring.
    pub fn wait_ready(&mut self, limit: Duration) -> Result<()> {
        let n = self.backends.len();
        let ok = wait_for(limit, || {
            if self.agent.exited() {
                return Some(());
            }
            let s = self.status()?;
            (s.held.len() == 1 && s.services.first()?.backends.len() == n).then_some(())
        });
        self.agent.check_alive()?;
        if ok.is_none() {
            bail!("agent not ready in {limit:?}; status {:?}; log:\n{}", self.status(), self.agent.log_text());
        }
        Ok(())
    }

    /// `count` connections from the client (source ports from `first_port`): answers by backend name.
    pub fn spread(&self, first_port: u16, count: u16) -> Result<BTreeMap<String, u32>> {
        self.client.run(move || {
            let mut seen = BTreeMap::new();
            for i in 0..count {
                let who = fetch(LB_CLIENT, first_port + i, SocketAddr::from((LB_VIP, 80))).unwrap_or_else(|e| format!("error: {e}"));
                *seen.entry(who).or_insert(0) += 1;
            }
            seen
        })
    }
}

fn path_str(p: &Path) -> Result<&str> {
    p.to_str().context("non-UTF-8 path")
}
