//! vip on a real cluster ([`crate::cluster`]), the way the README's Kubernetes
//! quick start installs it: `kubectl apply -k deploy/` with the image loaded on
//! every node, a VipPool, LoadBalancer Services backed by pods of the testpod
//! image, a client on the nodes' segment. Shared by the cluster test and bench.
use std::{
    collections::BTreeMap,
    io::{BufRead as _, BufReader, Write as _},
    net::{IpAddr, SocketAddr, TcpStream},
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc,
    },
    thread::JoinHandle,
    time::{Duration, Instant},
};

use anyhow::{anyhow, bail, ensure, Context as _, Result};
use serde_json::Value;
use vip_agent::status::Status;

use crate::{
    cluster::{http_get, Cluster, AGENT_IMAGE, TESTPOD_IMAGE},
    kubeapi::deploy_dir,
    mapmem::quantity_bytes,
    netns::NetNs,
};

/// The agents' /metrics, /status port (deploy/20-daemonset.yaml's --metrics-addr).
pub const METRICS_PORT: u16 = 9472;
/// The pool of the tests: on the nodes' segment, outside every node's address.
pub const POOL: &str = "198.18.0.200-198.18.0.219";
/// A prefix holding [`POOL`] and no other address on the segment.
pub const POOL_PREFIX: &str = "198.18.0.192/27";
/// [`POOL`]'s IPv6 twin (IPv6-only and dual-stack clusters).
pub const POOL6: &str = "2001:2::200-2001:2::21f";
/// The address of each pool the example's `excludedIPs` names instead of its own.
const EXCLUDED: &str = "198.18.0.210";
const EXCLUDED6: &str = "2001:2::210";

/// `kubectl apply -k deploy/` and the DaemonSet's rollout; how long until every
/// agent pod was Ready.
pub fn install(c: &Cluster) -> Result<Duration> {
    let t0 = Instant::now();
    c.apply_kustomize(&deploy_dir())?;
    c.wait_rollout("daemonset/vip-agent", "vip-system", Duration::from_secs(180))?;
    Ok(t0.elapsed())
}

/// deploy/examples/pool.yaml as the README says to use it: only its addresses
/// replaced by free ones of the segment ([`POOL`], [`POOL6`], as the cluster has
/// each family); then waits for its Ready condition (`kubectl wait
/// --for=condition=Ready vippool/default`).
pub fn apply_pool(c: &Cluster) -> Result<()> {
    let example = std::fs::read_to_string(deploy_dir().join("examples/pool.yaml"))?;
    let stack = c.spec().stack;
    let list = |v: Vec<&str>| v.iter().map(|a| format!("\"{a}\"")).collect::<Vec<_>>().join(", ");
    let (from, to) = ("addresses: [\"192.0.2.100-192.0.2.120\"]", format!("addresses: [{}]", list(stack.pick(POOL, POOL6))));
    let (xfrom, xto) = ("excludedIPs: [\"192.0.2.110\"]", format!("excludedIPs: [{}]", list(stack.pick(EXCLUDED, EXCLUDED6))));
    ensure!(example.contains(from) && example.contains(xfrom), "deploy/examples/pool.yaml no longer has the lines the README tells users to edit");
    c.apply_yaml(&example.replace(from, &to).replace(xfrom, &xto))?;
    c.kubectl(&["wait", "--for=condition=Ready", "vippool/default", "--timeout=60s"])?;
    Ok(())
}

/// deploy/examples/service.yaml as written (Service `web`, port 80 to 8080, pods
/// labelled app=web).
pub fn apply_example_service(c: &Cluster) -> Result<()> {
    c.apply_yaml(&std::fs::read_to_string(deploy_dir().join("examples/service.yaml"))?)
}

/// A Deployment of the testpod server (port 8080) named `name` with `replicas`
/// pods, spread one per node (or all on `node`), and a LoadBalancer Service of the
/// same name on port 80 with `policy` (Cluster or Local).
pub fn apply_web(c: &Cluster, name: &str, replicas: usize, policy: &str, node: Option<&str>) -> Result<()> {
    apply_web_with(c, name, replicas, policy, node, "")
}

/// [`apply_web`] with more lines of the Service's spec (`extra_spec`: each
/// indented by two spaces, ending in a newline), e.g. `ipFamilyPolicy`.
pub fn apply_web_with(c: &Cluster, name: &str, replicas: usize, policy: &str, node: Option<&str>, extra_spec: &str) -> Result<()> {
    apply_deployment(c, name, replicas, node)?;
    c.apply_yaml(&format!(
        r#"apiVersion: v1
kind: Service
metadata: {{name: {name}, namespace: default}}
spec:
  type: LoadBalancer
  externalTrafficPolicy: {policy}
{extra_spec}  selector: {{app: {name}}}
  ports: [{{port: 80, targetPort: 8080, protocol: TCP}}]
"#
    ))
}

/// A Deployment of the testpod server (port 8080) named `name`, pods labelled
/// app=`name`, spread one per node (or all on `node`); waits for its rollout.
pub fn apply_deployment(c: &Cluster, name: &str, replicas: usize, node: Option<&str>) -> Result<()> {
    let placement = match node {
        Some(n) => format!("nodeSelector: {{kubernetes.io/hostname: {n}}}"),
        None => format!(
            "affinity: {{podAntiAffinity: {{preferredDuringSchedulingIgnoredDuringExecution: [{{weight: 100, podAffinityTerm: \
             {{labelSelector: {{matchLabels: {{app: {name}}}}}, topologyKey: kubernetes.io/hostname}}}}]}}}}"
        ),
    };
    c.apply_yaml(&format!(
        r#"apiVersion: apps/v1
kind: Deployment
metadata: {{name: {name}, namespace: default}}
spec:
  replicas: {replicas}
  selector: {{matchLabels: {{app: {name}}}}}
  template:
    metadata: {{labels: {{app: {name}}}}}
    spec:
      {placement}
{}"#,
        serve(c, 6)
    ))?;
    c.wait_rollout(&format!("deployment/{name}"), "default", Duration::from_secs(120))
}

/// The testpod server's container and grace period: the lines of a pod spec,
/// each indented by `indent` spaces. With IPv6 in the cluster it listens on `::`
/// (either family; the default `0.0.0.0` is IPv4 only).
fn serve(c: &Cluster, indent: usize) -> String {
    let bind = if c.spec().stack.has_v6() { r#""--bind", "::", "# } else { "" };
    let lines = [
        "terminationGracePeriodSeconds: 1".to_owned(),
        "containers:".into(),
        "- name: serve".into(),
        format!("  image: {TESTPOD_IMAGE}"),
        "  imagePullPolicy: IfNotPresent".into(),
        format!(r#"  command: ["/vip-testpod", "serve", {bind}"--port", "8080"]"#),
        "  ports: [{containerPort: 8080}]".into(),
        "  readinessProbe: {tcpSocket: {port: 8080}, periodSeconds: 1}".into(),
    ];
    lines.iter().map(|l| format!("{:indent$}{l}\n", "")).collect()
}

/// A bare Pod `name` of the testpod server labelled app=`app` on `node` (another
/// endpoint for Service `app`, no controller); waits until it is Ready.
pub fn apply_pod(c: &Cluster, name: &str, app: &str, node: &str) -> Result<()> {
    c.apply_yaml(&format!(
        "apiVersion: v1\nkind: Pod\nmetadata: {{name: {name}, namespace: default, labels: {{app: {app}}}}}\nspec:\n  nodeSelector: {{kubernetes.io/hostname: {node}}}\n{}",
        serve(c, 2)
    ))?;
    c.kubectl(&["-n", "default", "wait", "--for=condition=Ready", &format!("pod/{name}"), "--timeout=120s"])?;
    Ok(())
}

/// The address vip gave Service `name` (waits for it).
pub fn wait_vip(c: &Cluster, name: &str, limit: Duration) -> Result<IpAddr> {
    Ok(wait_vips(c, name, 1, limit)?[0])
}

/// The first `n` addresses vip gave Service `name`, in `status.loadBalancer.ingress`
/// order (waits until it has `n`).
pub fn wait_vips(c: &Cluster, name: &str, n: usize, limit: Duration) -> Result<Vec<IpAddr>> {
    poll(&format!("{n} address(es) for Service {name}"), limit, || {
        let s = c.get(&format!("/api/v1/namespaces/default/services/{name}"))?;
        let ips: Vec<IpAddr> = s["status"]["loadBalancer"]["ingress"].as_array().into_iter().flatten().filter_map(|i| i["ip"].as_str()?.parse().ok()).collect();
        Ok((ips.len() >= n).then(|| ips[..n].to_vec()))
    })
}

/// Node `i`'s agent status (its /status, read from the client as a user would).
pub fn status(c: &Cluster, i: usize) -> Result<Status> {
    let (code, body) = http_get(c.client(), SocketAddr::from((c.node(i).addr, METRICS_PORT)), "/status")?;
    ensure!(code == 200, "/status of node {i}: HTTP {code}");
    serde_json::from_str(&body).with_context(|| format!("/status of node {i}"))
}

/// The sum of the samples of `metric` whose labels contain every `labels` pair
/// (`reason="forwarded"`), from node `i`'s /metrics.
pub fn metric(c: &Cluster, i: usize, metric: &str, labels: &[&str]) -> Result<f64> {
    let (code, body) = http_get(c.client(), SocketAddr::from((c.node(i).addr, METRICS_PORT)), "/metrics")?;
    ensure!(code == 200, "/metrics of node {i}: HTTP {code}");
    Ok(body
        .lines()
        .filter(|l| l.starts_with(metric) && l[metric.len()..].starts_with(['{', ' ', '_']))
        .filter(|l| labels.iter().all(|p| l.contains(p)))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum())
}

/// The node every agent agrees holds `vip` (waits until they agree).
pub fn holder(c: &Cluster, vip: IpAddr, limit: Duration) -> Result<String> {
    poll(&format!("one owner of {vip} agreed by every agent"), limit, || {
        let mut owners = Vec::new();
        for i in 0..c.nodes().len() {
            owners.push(status(c, i).ok().and_then(|s| s.owners.get(&vip).cloned()));
        }
        Ok(match owners.first() {
            Some(Some(o)) if owners.iter().all(|x| x.as_ref() == Some(o)) => Some(o.clone()),
            _ => None,
        })
    })
}

/// Waits until the client resolves `vip` to `holder`'s MAC, or has no entry for
/// it (its next ARP request is answered by the holder alone): the new holder's
/// gratuitous ARP has reached it, and no connection of a load started now can
/// begin on one node and go on to another.
pub fn client_follows(c: &Cluster, vip: IpAddr, holder: &str, limit: Duration) -> Result<()> {
    let mac = c.node_by_name(holder).with_context(|| format!("no node {holder}"))?.ns.mac("eth0")?;
    let want = mac.iter().map(|b| format!("{b:02x}")).collect::<Vec<_>>().join(":");
    poll(&format!("the client resolving {vip} to {holder} ({want})"), limit, || {
        let out = c.client().cmd("ip").args(["-j", "neigh", "show", &vip.to_string()]).output()?;
        let entries: serde_json::Value = serde_json::from_slice(&out.stdout)?;
        let macs: Vec<&str> = entries.as_array().into_iter().flatten().filter_map(|e| e["lladdr"].as_str()).collect();
        Ok(macs.iter().all(|m| *m == want).then_some(()))
    })
}

/// The client's neighbour entry for `vip` as `ip neigh` shows it (for errors).
fn client_neigh(c: &Cluster, vip: IpAddr) -> String {
    match c.client().cmd("ip").args(["neigh", "show", &vip.to_string()]).output() {
        Ok(o) => String::from_utf8_lossy(&o.stdout).trim().to_owned(),
        Err(e) => format!("(ip neigh: {e})"),
    }
}

/// Pod name → node name, for the pods of Deployment `app`.
pub fn pod_nodes(c: &Cluster, app: &str) -> Result<BTreeMap<String, String>> {
    let pods = c.get(&format!("/api/v1/namespaces/default/pods?labelSelector=app%3D{app}"))?;
    Ok(pods["items"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|p| Some((p["metadata"]["name"].as_str()?.to_owned(), p["spec"]["nodeName"].as_str()?.to_owned())))
        .collect())
}

/// `n` new connections from the client to `vip`:80 (each from its own port);
/// which pod answered each. Fails on the first that fails.
pub fn spread(c: &Cluster, vip: IpAddr, n: usize) -> Result<BTreeMap<String, usize>> {
    let addr = SocketAddr::from((vip, 80));
    c.client().run(move || -> Result<BTreeMap<String, usize>> {
        let mut seen = BTreeMap::new();
        for k in 0..n {
            let (pod, _) = greet(addr).with_context(|| format!("connection {} of {n} to {addr}", k + 1))?;
            *seen.entry(pod).or_insert(0) += 1;
        }
        Ok(seen)
    })?
}

/// One connection: the testpod's greeting (`POD PEER`) and the open stream.
fn greet(addr: SocketAddr) -> Result<(String, BufReader<TcpStream>)> {
    let s = TcpStream::connect_timeout(&addr, Duration::from_secs(2))?;
    s.set_read_timeout(Some(Duration::from_secs(2)))?;
    s.set_write_timeout(Some(Duration::from_secs(2)))?;
    let mut r = BufReader::new(s);
    let mut line = String::new();
    r.read_line(&mut line)?;
    let pod = line.split_whitespace().next().ok_or_else(|| anyhow!("no greeting from {addr}"))?.to_owned();
    Ok((pod, r))
}

/// What a [`Load`] saw.
#[derive(Clone, Debug, Default)]
pub struct LoadReport {
    /// New connections tried, and those that failed (not connected, or no greeting
    /// within 2 s).
    pub attempts: u32,
    pub failed: u32,
    /// The longest time between two successful new connections.
    pub longest_gap: Duration,
    /// When, after the load's start, that gap ended.
    pub gap_end: Duration,
    /// Long-lived connections, by the pod that serves them, and those that broke
    /// (an echo not returned within 2 s, or the connection reset).
    pub long_lived: BTreeMap<String, u32>,
    pub broken: BTreeMap<String, u32>,
    /// Each break: the pod, when its last echo was sent, and the error.
    pub broken_how: Vec<String>,
    /// When each break's last echo was sent, and when each failed new connection
    /// was tried, after the load's start.
    pub broken_at: Vec<Duration>,
    pub failed_at: Vec<Duration>,
    /// Each failed new connection: when (after the start, and the time of day in
    /// UTC, to set beside the agents' logs) and the error.
    pub failed_how: Vec<String>,
}

impl LoadReport {
    pub fn broken_total(&self) -> u32 {
        self.broken.values().sum()
    }
}

/// What the long-lived connections of a [`Load`] report.
type LongLived = (BTreeMap<String, u32>, BTreeMap<String, u32>, Vec<String>, Vec<Duration>);

/// The new-connection thread's tally: attempts, the failures (when, and how),
/// the longest gap between successes and when it ended.
type NewConnections = (u32, Vec<(Duration, String)>, Duration, Duration);

/// A client load on `vip`:80 from the client namespace: a new connection every
/// 20 ms, and long-lived connections each echoing a line every 100 ms. Bounded:
/// it stops at [`Load::finish`] or after 10 minutes.
pub struct Load {
    stop: Arc<AtomicBool>,
    started: Instant,
    new: JoinHandle<NewConnections>,
    long: JoinHandle<LongLived>,
}

impl Load {
    pub fn start(client: &NetNs, vip: IpAddr, long_lived: usize) -> Result<Self> {
        let addr = SocketAddr::from((vip, 80));
        let stop = Arc::new(AtomicBool::new(false));
        let started = Instant::now();
        let mut conns = Vec::new();
        for _ in 0..long_lived {
            conns.push(client.run(move || greet(addr))??);
        }
        let s = stop.clone();
        let new = client.spawn(move || {
            let (mut attempts, mut failed) = (0, Vec::new());
            let (mut last_ok, mut longest, mut gap_end) = (Instant::now(), Duration::ZERO, Duration::ZERO);
            while !s.load(Ordering::Relaxed) && started.elapsed() < Duration::from_secs(600) {
                attempts += 1;
                let tried = started.elapsed();
                match greet(addr) {
                    Ok(_) => {
                        let now = Instant::now();
                        if now - last_ok > longest {
                            longest = now - last_ok;
                            gap_end = now - started;
                        }
                        last_ok = now;
                    }
                    Err(e) => failed.push((tried, format!("{} UTC: {e:#}", utc_now()))),
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            (attempts, failed, longest, gap_end)
        })?;
        let s = stop.clone();
        let long = client.spawn(move || {
            let mut served: BTreeMap<String, u32> = BTreeMap::new();
            let mut broken: BTreeMap<String, u32> = BTreeMap::new();
            let mut how: Vec<String> = Vec::new();
            let mut at: Vec<Duration> = Vec::new();
            let mut live: Vec<(String, BufReader<TcpStream>)> = conns;
            for (pod, _) in &live {
                *served.entry(pod.clone()).or_insert(0) += 1;
            }
            let mut k = 0u64;
            while !s.load(Ordering::Relaxed) && started.elapsed() < Duration::from_secs(600) {
                k += 1;
                live.retain_mut(|(pod, r)| {
                    let sent = Instant::now();
                    let outcome = (|| -> std::io::Result<String> {
                        writeln!(r.get_mut(), "ping {k}")?;
                        let mut e = String::new();
                        r.read_line(&mut e)?;
                        Ok(e.trim_end().to_owned())
                    })();
                    let why = match outcome {
                        Ok(e) if e == format!("ping {k}") => return true,
                        Ok(e) => format!("answered {e:?}"),
                        Err(e) => e.to_string(),
                    };
                    *broken.entry(pod.clone()).or_insert(0) += 1;
                    how.push(format!("{pod} at {:?}: {why}", sent - started));
                    at.push(sent - started);
                    false
                });
                std::thread::sleep(Duration::from_millis(100));
            }
            (served, broken, how, at)
        })?;
        Ok(Self { stop, started, new, long })
    }

    /// How long the load has run.
    pub fn elapsed(&self) -> Duration {
        self.started.elapsed()
    }

    pub fn finish(self) -> Result<LoadReport> {
        self.stop.store(true, Ordering::Relaxed);
        let (attempts, failed, longest_gap, gap_end) = self.new.join().map_err(|_| anyhow!("the new-connection thread panicked"))?;
        let (long_lived, broken, broken_how, broken_at) = self.long.join().map_err(|_| anyhow!("the long-lived thread panicked"))?;
        let failed_at = failed.iter().map(|(t, _)| *t).collect();
        let failed_how: Vec<String> = failed.into_iter().map(|(t, how)| format!("at {t:?} ({how})")).collect();
        Ok(LoadReport { attempts, failed: failed_how.len() as u32, longest_gap, gap_end, long_lived, broken, broken_how, broken_at, failed_at, failed_how })
    }
}

/// The memory cgroup (v1) charge of the pod with `uid` on `node`: (now, peak) bytes.
pub fn pod_memory(c: &Cluster, node: usize, uid: &str) -> Result<(u64, u64)> {
    let root = c.node(node).cgroups().iter().find(|p| p.starts_with("/sys/fs/cgroup/memory")).cloned().ok_or_else(|| anyhow!("no memory cgroup"))?;
    let want = format!("pod{uid}");
    let dir = find_dir(&root, &want, 4).ok_or_else(|| anyhow!("no cgroup {want} under {}", root.display()))?;
    let read = |f: &str| -> Result<u64> { Ok(std::fs::read_to_string(dir.join(f))?.trim().parse()?) };
    Ok((read("memory.usage_in_bytes")?, read("memory.max_usage_in_bytes")?))
}

fn find_dir(dir: &std::path::Path, name: &str, depth: u32) -> Option<std::path::PathBuf> {
    for e in std::fs::read_dir(dir).ok()?.flatten() {
        let p = e.path();
        if !p.is_dir() {
            continue;
        }
        if p.file_name().is_some_and(|n| n == name) {
            return Some(p);
        }
        if depth > 0 {
            if let Some(f) = find_dir(&p, name, depth - 1) {
                return Some(f);
            }
        }
    }
    None
}

/// The vip-agent pod on each node: node name → pod object.
pub fn agent_pods(c: &Cluster) -> Result<BTreeMap<String, Value>> {
    let pods = c.get("/api/v1/namespaces/vip-system/pods?labelSelector=app.kubernetes.io%2Fname%3Dvip")?;
    Ok(pods["items"].as_array().into_iter().flatten().filter_map(|p| Some((p["spec"]["nodeName"].as_str()?.to_owned(), p.clone()))).collect())
}

/// The containerd id of the vip-agent container on node `node` (from its pod's
/// status), for `ctr tasks`.
pub fn agent_container_id(c: &Cluster, node: &str) -> Result<String> {
    let pods = agent_pods(c)?;
    let pod = pods.get(node).ok_or_else(|| anyhow!("no vip-agent pod on {node}"))?;
    let id = pod["status"]["containerStatuses"][0]["containerID"].as_str().ok_or_else(|| anyhow!("{node}: the vip-agent pod has no container id yet"))?;
    Ok(id.trim_start_matches("containerd://").to_owned())
}

/// One vip-agent pod's memory cgroup charge.
#[derive(Clone, Debug)]
pub struct PodMemory {
    pub node: String,
    pub pod: String,
    /// Bytes charged now, and the most ever charged (memory.max_usage_in_bytes).
    pub now: u64,
    pub peak: u64,
}

/// The memory limit of the agent container (the manifest's `limits.memory`) and
/// each agent pod's charge, in node order.
pub fn agent_memory(c: &Cluster) -> Result<(u64, Vec<PodMemory>)> {
    let pods = agent_pods(c)?;
    let any = pods.values().next().ok_or_else(|| anyhow!("no vip-agent pod"))?;
    let limit = any["spec"]["containers"][0]["resources"]["limits"]["memory"].as_str().ok_or_else(|| anyhow!("the agent container has no memory limit"))?;
    let limit = quantity_bytes(limit)?;
    let mut out = Vec::new();
    for (i, node) in c.nodes().iter().enumerate() {
        let pod = pods.get(&node.name).ok_or_else(|| anyhow!("no vip-agent pod on {}", node.name))?;
        let uid = pod["metadata"]["uid"].as_str().ok_or_else(|| anyhow!("{}: a pod without a uid", node.name))?;
        let (now, peak) = pod_memory(c, i, uid)?;
        out.push(PodMemory { node: node.name.clone(), pod: pod["metadata"]["name"].as_str().unwrap_or_default().to_owned(), now, peak });
    }
    Ok((limit, out))
}

/// What a fault on the holder of a VIP did to a [`Load`] on it.
#[derive(Clone, Debug)]
pub struct FaultReport {
    /// The node that held the VIP and got the fault.
    pub victim: String,
    /// When, after the load's start, the fault was made.
    pub fault_at: Duration,
    /// The holder every agent agreed on after the fault (agent kill), or the owner
    /// the other agents moved the VIP to (link cut); None: not seen in time.
    pub new_holder: Option<String>,
    pub load: LoadReport,
    /// The Service's pods → their nodes, taken before the fault.
    pub pod_nodes: BTreeMap<String, String>,
}

impl FaultReport {
    /// Long-lived connections (served, broken) by pods on the victim (`true`) or
    /// on the other nodes (`false`).
    pub fn long_lived_on(&self, victim: bool) -> (u32, u32) {
        let on = |m: &BTreeMap<String, u32>| -> u32 {
            m.iter().filter(|(p, _)| self.pod_nodes.get(*p).is_some_and(|n| (n == &self.victim) == victim)).map(|(_, k)| *k).sum()
        };
        (on(&self.load.long_lived), on(&self.load.broken))
    }
}

impl FaultReport {
    /// Fails unless some long-lived connection was served by a node the fault
    /// spared, and none of those broke (`what`: the fault, for the message).
    pub fn survivors_kept(&self, c: &Cluster, what: &str) -> Result<()> {
        let (served, broken) = self.long_lived_on(false);
        ensure!(served > 0, "{what}: no long-lived connection was served by a surviving node: {self:?}");
        ensure!(broken == 0, "{what}: {broken} long-lived connections served by surviving nodes broke: {self:?}\n{}", agent_logs(c));
        Ok(())
    }
}

/// The holder of `vip` (Service `app`): its index and name, and the Service's pods.
fn victim(c: &Cluster, app: &str, vip: IpAddr) -> Result<(usize, String, BTreeMap<String, String>)> {
    let name = holder(c, vip, Duration::from_secs(30))?;
    let v = c.nodes().iter().position(|x| x.name == name).ok_or_else(|| anyhow!("the holder {name} is not a node"))?;
    Ok((v, name, pod_nodes(c, app)?))
}

/// Under a [`Load`] (12 long-lived connections) on `vip`, the holder's vip-agent
/// container gets SIGKILL (`ctr tasks kill`); the load runs on until the DaemonSet
/// is whole again (the kubelet restarted the container) and 2 s more.
pub fn kill_agent_trial(c: &Cluster, app: &str, vip: IpAddr) -> Result<FaultReport> {
    let (v, victim, pod_nodes) = victim(c, app, vip)?;
    let load = Load::start(c.client(), vip, 12)?;
    std::thread::sleep(Duration::from_secs(1));
    let id = agent_container_id(c, &victim)?;
    let fault_at = load.elapsed();
    c.node(v).ctr(&["tasks", "kill", "-s", "SIGKILL", &id])?;
    let new_holder = holder(c, vip, Duration::from_secs(10)).ok();
    // Until the kubelet has seen the container die, the DaemonSet still counts it.
    std::thread::sleep(Duration::from_secs(2));
    c.wait_rollout("daemonset/vip-agent", "vip-system", Duration::from_secs(120))?;
    std::thread::sleep(Duration::from_secs(2));
    let load = load.finish()?;
    Ok(FaultReport { victim, fault_at, new_holder, load, pod_nodes })
}

/// Under a [`Load`] (12 long-lived connections) on `vip`, the holder is cut off
/// the segment (its bridge port disabled, the link stays up); the load runs until
/// the other agents have moved the VIP and 3 s more. The link stays cut: the
/// caller restores it ([`restore_link`]), after [`wait_cut_node_tainted`] or not.
/// Fails (after finishing the load) when the VIP did not move within 10 s.
pub fn cut_link_trial(c: &Cluster, app: &str, vip: IpAddr) -> Result<FaultReport> {
    let (v, victim, pod_nodes) = victim(c, app, vip)?;
    let load = Load::start(c.client(), vip, 12)?;
    std::thread::sleep(Duration::from_secs(1));
    let fault_at = load.elapsed();
    c.segment().isolate(&c.node(v).ns, true)?;
    let others: Vec<usize> = (0..c.nodes().len()).filter(|i| *i != v).collect();
    let moved = poll("the VIP moved off the cut node", Duration::from_secs(10), || {
        let owners: Vec<Option<String>> = others.iter().map(|i| status(c, *i).ok().and_then(|s| s.owners.get(&vip).cloned())).collect();
        Ok(match owners.first() {
            Some(Some(o)) if *o != victim && owners.iter().all(|x| x.as_ref() == Some(o)) => Some(o.clone()),
            _ => None,
        })
    });
    std::thread::sleep(Duration::from_secs(3));
    let load = load.finish()?;
    let new_holder = Some(moved.with_context(|| format!("the load: {load:?}"))?);
    Ok(FaultReport { victim, fault_at, new_holder, load, pod_nodes })
}

/// The cut node `victim` goes NotReady (Unknown: its kubelet is silent) and is
/// tainted unreachable by the controller manager; how long that took.
pub fn wait_cut_node_tainted(c: &Cluster, victim: &str) -> Result<Duration> {
    let not_ready = c.wait_node_ready_status(victim, "Unknown", Duration::from_secs(90))?;
    // The controller manager writes the condition and the taint in two updates.
    poll(&format!("the cut node {victim} tainted unreachable"), Duration::from_secs(30), || {
        let node = c.get(&format!("/api/v1/nodes/{victim}"))?;
        Ok(node["spec"]["taints"].as_array().is_some_and(|ts| ts.iter().any(|t| t["key"] == "node.kubernetes.io/unreachable")).then_some(()))
    })?;
    Ok(not_ready)
}

/// After [`restore_link`]: how long until the node was Ready, and until every
/// agent had every node in the Service's ring again; who holds the VIP then.
#[derive(Clone, Debug)]
pub struct Rejoin {
    pub ready: Duration,
    pub in_ring: Duration,
    pub holder: String,
}

/// Joins the cut node `victim` to the segment again: it is Ready, every agent has
/// every node in `vip`'s ring again, and new connections reach every pod of the
/// Service (a pod on each node) again.
pub fn restore_link(c: &Cluster, victim: &str, vip: IpAddr) -> Result<Rejoin> {
    let v = c.nodes().iter().position(|x| x.name == victim).ok_or_else(|| anyhow!("{victim} is not a node"))?;
    let t0 = Instant::now();
    c.segment().isolate(&c.node(v).ns, false)?;
    let ready = c.wait_node_ready_status(victim, "True", Duration::from_secs(90))?;
    let holder = holder(c, vip, Duration::from_secs(30))?;
    let n = c.nodes().len();
    // Every node in every agent's ring, not only the victim: the cut node's own
    // agent took its peers out too (failed health checks) and puts them back
    // (rise) about when they put it back; until then the VIP's traffic can reach
    // one node's pod only.
    let names: Vec<String> = c.nodes().iter().map(|x| x.name.clone()).collect();
    poll("every agent putting the node back in the Service's ring", Duration::from_secs(30), || {
        Ok((0..n).all(|i| status(c, i).is_ok_and(|s| s.services.iter().any(|x| x.vip == vip && names.iter().all(|m| x.backends.contains(m))))).then_some(()))
    })?;
    let in_ring = t0.elapsed();
    // The VIP may have moved at the heal (two holders agreed on one): as in
    // upgrade_under_load, new connections start once the client follows its holder.
    client_follows(c, vip, &holder, Duration::from_secs(10))?;
    let seen = spread(c, vip, 20).with_context(|| format!("{holder} holding {vip}; the client's entry for it: {}", client_neigh(c, vip)))?;
    ensure!(seen.len() == n, "after {victim} came back, 20 connections reached only {seen:?}");
    Ok(Rejoin { ready, in_ring, holder })
}

/// A rolling upgrade of the vip-agent DaemonSet.
#[derive(Clone, Debug)]
pub enum Upgrade {
    /// `kubectl rollout restart`: new pods, same image.
    RolloutRestart,
    /// `kubectl set image` to this name, tagged on every node as the same image
    /// (a new image as far as Kubernetes knows).
    Image(String),
}

impl Upgrade {
    /// The image change the cluster test makes: [`AGENT_IMAGE`] with `-next` appended.
    pub fn next_image() -> Self {
        Upgrade::Image(format!("{AGENT_IMAGE}-next"))
    }
}

/// Under a [`Load`] (12 long-lived connections) on `vip`, the DaemonSet is
/// upgraded; the load runs until its rollout is complete and 3 s more.
pub fn upgrade_under_load(c: &Cluster, vip: IpAddr, upgrade: &Upgrade) -> Result<LoadReport> {
    // From a settled VIP: the previous step may have just moved it (a handshake
    // whose SYN the old holder passed to its own stack and whose ACK reaches the
    // new one fails; the upgrade is not what that measures).
    client_follows(c, vip, &holder(c, vip, Duration::from_secs(30))?, Duration::from_secs(10))?;
    let load = Load::start(c.client(), vip, 12)?;
    std::thread::sleep(Duration::from_secs(1));
    match upgrade {
        Upgrade::RolloutRestart => {
            c.kubectl(&["-n", "vip-system", "rollout", "restart", "daemonset/vip-agent"])?;
        }
        Upgrade::Image(image) => {
            for node in c.nodes() {
                node.ctr(&["images", "tag", "--force", AGENT_IMAGE, image])?;
            }
            c.kubectl(&["-n", "vip-system", "set", "image", "daemonset/vip-agent", &format!("agent={image}")])?;
        }
    }
    std::thread::sleep(Duration::from_secs(1));
    c.wait_rollout("daemonset/vip-agent", "vip-system", Duration::from_secs(180))?;
    std::thread::sleep(Duration::from_secs(3));
    load.finish()
}

/// Polls `f` every 100 ms until it gives a value, for at most `limit`.
pub fn poll<T>(what: &str, limit: Duration, mut f: impl FnMut() -> Result<Option<T>>) -> Result<T> {
    let t0 = Instant::now();
    let mut last = None;
    loop {
        match f() {
            Ok(Some(v)) => return Ok(v),
            Ok(None) => {}
            Err(e) => last = Some(e),
        }
        if t0.elapsed() > limit {
            match last {
                Some(e) => bail!("{what}: not within {limit:?} (last error: {e:#})"),
                None => bail!("{what}: not within {limit:?}"),
            }
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// The time of day in UTC (HH:MM:SS.mmm), as the agents' logs stamp it.
fn utc_now() -> String {
    let d = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
    let s = d.as_secs() % 86_400;
    format!("{:02}:{:02}:{:02}.{:03}", s / 3600, s / 60 % 60, s % 60, d.subsec_millis())
}

/// The agents' logs, current and previous containers (for failure messages).
pub fn agent_logs(c: &Cluster) -> String {
    let mut s = String::new();
    for (node, pod) in agent_pods(c).unwrap_or_default() {
        let name = pod["metadata"]["name"].as_str().unwrap_or_default().to_owned();
        for prev in [true, false] {
            let mut args = vec!["-n", "vip-system", "logs", name.as_str(), "--timestamps"];
            if prev {
                args.push("--previous");
            }
            let text = c.kubectl(&args).map(|o| String::from_utf8_lossy(&o.stdout).into_owned()).unwrap_or_else(|e| format!("{e:#}"));
            let lines: Vec<&str> = text.lines().collect();
            s += &format!("--- {node} {name}{}\n{}\n", if prev { " (previous)" } else { "" }, lines[lines.len().saturating_sub(60)..].join("\n"));
        }
    }
    s
}

/// Waits until kube-proxy on every node serves the healthCheckNodePort of the
/// `externalTrafficPolicy: Local` Service `name`: it starts serving it in the
/// sync that installs the Service's Local rules, so connections made from then
/// on take the Local path on every node (made before, a node may still DNAT them
/// to another node's pod, through its own conntrack).
pub fn wait_local_synced(c: &Cluster, name: &str, limit: Duration) -> Result<()> {
    poll(&format!("kube-proxy serving the healthCheckNodePort of {name} on every node"), limit, || {
        let svc = c.get(&format!("/api/v1/namespaces/default/services/{name}"))?;
        let Some(port) = svc["spec"]["healthCheckNodePort"].as_u64() else { return Ok(None) };
        let all = c.nodes().iter().all(|n| {
            http_get(&n.ns, SocketAddr::from((n.addr, port as u16)), "/healthz")
                .is_ok_and(|(code, body)| (code == 200 || code == 503) && body.contains("localEndpoints"))
        });
        Ok(all.then_some(()))
    })
}
