//! The high-availability lab: N nodes on one L2 segment, each running the real
//! `vip-agent` (file mode, one shared config), each a backend with every VIP on
//! its loopback and a server answering its node name; one client. Used by the
//! failover tests, the failover benchmarks and `cargo xtask lab`.
//!
//! Tests build it with unique namespace names and remove it on Drop; `cargo xtask
//! lab up` builds it with fixed names (`vlab-*`) and `persist`s it until `lab down`.
use std::{
    collections::{BTreeMap, BTreeSet},
    io::{BufRead, BufReader, Write},
    net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, TcpListener, TcpStream},
    path::{Path, PathBuf},
    process::{Child, Stdio},
    time::{Duration, Instant},
};

use anyhow::{bail, ensure, Context as _, Result};
use vip_agent::{dataplane::AttachMode, status::Status};

use crate::{
    agent::{wait_for, write_atomic, AgentProc},
    lab::{accept_vip, mode_arg, xdp_mode, Segment},
    netns::{sh, unique, NetNs, PinDir},
};

pub const CLIENT: Ipv4Addr = Ipv4Addr::new(198, 18, 0, 100);
/// The client's IPv6 address with [`HaSpec::ipv6`] (2001:2::/64, on the segment).
pub const CLIENT6: Ipv6Addr = Ipv6Addr::new(0x2001, 2, 0, 0, 0, 0, 0, 0x100);
pub const SERVICE_PORT: u16 = 80;

/// The lab's shape and timers.
#[derive(Clone, Debug)]
pub struct HaSpec {
    /// The agents' model: the shared YAML file (None) or the Kubernetes API through
    /// this kubeconfig (`run --kubernetes`).
    pub kubeconfig: Option<PathBuf>,
    /// The Kubernetes API as a DaemonSet's pod reaches it (`run --kubernetes`
    /// with no kubeconfig; wins over `kubeconfig`).
    pub in_cluster: Option<crate::agent::InCluster>,
    pub nodes: usize,
    pub vips: usize,
    pub check_interval_ms: u64,
    pub check_fall: u32,
    pub hold_ms: u64,
    pub heartbeat_ms: u64,
    pub dead_after_ms: u64,
    /// Ports of each VIP's service.
    pub ports: Vec<u16>,
    /// Each service's `tableSize`; None: the default (16381).
    pub table_size: Option<u32>,
    /// Services carry an HTTP health check.
    pub health_check: bool,
    /// The health check's port, where every node runs a health server of its own
    /// beside the service's (as kube-proxy's health server is beside the pods),
    /// which a test can stop and start ([`HaLab::stop_health`]); None: the
    /// service's port, on its server.
    pub health_port: Option<u16>,
    /// Leave `announce` and `failover` out of the config: the agents run on the
    /// defaults a new user gets (the timer fields above are then unused).
    pub default_timers: bool,
    /// Give each service its own prime table size from 251 up (so that no two
    /// share a ring), overriding `table_size`.
    pub distinct_tables: bool,
    /// The agents' `--ring-capacity` (None: the default).
    pub ring_capacity: Option<u32>,
    /// Heartbeats on a network of their own: each node's address (heartbeats,
    /// health checks) is on a second segment (`eth1`, [`heartbeat_addr`]), while
    /// VIPs are answered and forwarded on `eth0` (MACs given in the file).
    pub heartbeat_net: bool,
    /// How the agents attach XDP (`run --mode`); default: the labs' [`xdp_mode`].
    pub xdp_mode: AttachMode,
    /// The agents' HTTP port on every address of their namespace, bound as
    /// deploy/20-daemonset.yaml binds it (`--metrics-addr`), for a Prometheus on
    /// the segment and the kubelet's probes; else on 127.0.0.1 only.
    pub metrics_on_segment: bool,
    /// The agents' `--arp-check-interval` in ms (None: the default, 45 s).
    pub arp_check_ms: Option<u64>,
    /// Dual-stack: every VIP `k` has an IPv6 twin [`vip6`]`(k)` in the same pool,
    /// with a service of its own on the same ports, and the client and every node
    /// also have an address in 2001:2::/64 on the segment (a backend answers the
    /// client directly). Node addresses (heartbeats, health checks) stay IPv4.
    pub ipv6: bool,
    /// IPv6-only (with `ipv6`): the client and the nodes have no IPv4 address,
    /// each node's address is [`node_addr6`], and the IPv4 VIPs are neither routed
    /// to nor accepted (a Kubernetes lab's pool holds only IPv6 addresses).
    pub ipv6_only: bool,
    /// The agent binary every node starts with (another release's, for upgrade
    /// tests); None: this build's. A node's can be changed ([`HaNode::agent_bin`]).
    pub agent_bin: Option<PathBuf>,
    /// The pool is `announce: lo, distribution: all` (every live node holds every
    /// VIP on its `lo`, for a routing daemon), and the nodes accept the VIPs by
    /// local routes rather than addresses on `lo`, so that `lo` holds only what
    /// the agents put there (not with `ipv6_only`).
    pub lo_everywhere: bool,
    /// The pool is `announce: bgp` with these sessions (with `lo_everywhere`'s
    /// local routes): every node runs FRR in [`HaLab::frr_dir`], which its agent
    /// drives (`--frr-config`, `--frr-vty-dir`).
    pub bgp: Option<BgpSpec>,
}

/// The config file's `bgp` section for [`HaSpec::bgp`].
#[derive(Clone, Debug)]
pub struct BgpSpec {
    pub my_asn: u32,
    /// Every node peers with each (address, AS).
    pub peers: Vec<(IpAddr, u32)>,
    pub keepalive_s: u32,
    pub hold_s: u32,
    /// BFD on every session, with FRR's default profile (300 ms, 3).
    pub bfd: bool,
    /// Communities on the pool's routes.
    pub communities: Vec<String>,
}

impl BgpSpec {
    /// The file's `bgp` section.
    pub fn section(&self) -> String {
        let mut y = format!("bgp:\n  myASN: {}\n", self.my_asn);
        if self.bfd {
            y += "  bfdProfiles:\n    - {name: lab}\n";
        }
        y += "  peers:\n";
        for (addr, asn) in &self.peers {
            let bfd = if self.bfd { ", bfdProfile: lab" } else { "" };
            y += &format!("    - {{address: '{addr}', asn: {asn}, keepaliveTime: {}s, holdTime: {}s{bfd}}}\n", self.keepalive_s, self.hold_s);
        }
        y
    }
}

impl Default for HaSpec {
    fn default() -> Self {
        // Health checks slower than failover: a dead owner's VIPs move (and its
        // flows get pinned by the new owner) before it leaves the rings as a backend.
        Self {
            kubeconfig: None,
            in_cluster: None,
            nodes: 3,
            vips: 3,
            check_interval_ms: 200,
            check_fall: 3,
            hold_ms: 180,
            heartbeat_ms: 40,
            dead_after_ms: 250,
            ports: vec![SERVICE_PORT],
            table_size: Some(251),
            health_check: true,
            health_port: None,
            default_timers: false,
            distinct_tables: false,
            ring_capacity: None,
            heartbeat_net: false,
            xdp_mode: xdp_mode(),
            metrics_on_segment: false,
            arp_check_ms: None,
            ipv6: false,
            agent_bin: None,
            ipv6_only: false,
            lo_everywhere: false,
            bgp: None,
        }
    }
}

/// The /112 the IPv6 VIPs ([`vip6`]) lie in.
pub const VIP6_NET: &str = "2001:2::1:0/112";

/// VIPs per /24 of the lab's VIP range (198.18.1.0/24 onwards, .10 to .209).
const VIPS_PER_NET: usize = 200;

pub fn vip(k: usize) -> Ipv4Addr {
    Ipv4Addr::new(198, 18, 1 + (k / VIPS_PER_NET) as u8, 10 + (k % VIPS_PER_NET) as u8)
}

/// VIP `k`'s IPv6 twin ([`HaSpec::ipv6`]): 2001:2::1:a onwards, in the
/// segment's /64 (on-link for the client, as the IPv4 VIPs are made).
pub fn vip6(k: usize) -> Ipv6Addr {
    Ipv6Addr::new(0x2001, 2, 0, 0, 0, 0, 1, 10 + k as u16)
}

/// Node `i`'s IPv6 address on the segment ([`HaSpec::ipv6`]).
pub fn node_addr6(i: usize) -> Ipv6Addr {
    Ipv6Addr::new(0x2001, 2, 0, 0, 0, 0, 0, 0x11 + i as u16)
}

/// The /24s the first `n` VIPs lie in.
pub fn vip_nets(n: usize) -> Vec<String> {
    (0..n.div_ceil(VIPS_PER_NET)).map(|i| format!("198.18.{}.0/24", 1 + i)).collect()
}

/// Node `i`'s address on the heartbeat network of [`HaSpec::heartbeat_net`].
pub fn heartbeat_addr(i: usize) -> Ipv4Addr {
    Ipv4Addr::new(198, 19, 0, 11 + i as u8)
}

/// Node `i`'s `eth0` MAC when [`HaSpec::heartbeat_net`] sets it.
pub fn uplink_mac(i: usize) -> [u8; 6] {
    [0x02, 0x00, 0x00, 0x00, 0x01, 1 + i as u8]
}

pub fn node_addr(i: usize) -> Ipv4Addr {
    Ipv4Addr::new(198, 18, 0, 11 + i as u8)
}

/// The shared config: every node may hold every VIP and backs every service.
pub fn ha_config(s: &HaSpec) -> String {
    ha_config_of(s, &(0..s.nodes).collect::<Vec<_>>())
}

/// [`ha_config`] listing only the lab's nodes `members` (indices): the others are
/// out of the model.
pub fn ha_config_of(s: &HaSpec, members: &[usize]) -> String {
    let mut y = String::from("# vip lab: every node holds VIPs and is a backend\nnodes:\n");
    for &i in members {
        if s.heartbeat_net {
            let mac = uplink_mac(i).map(|b| format!("{b:02x}")).join(":");
            y += &format!("  - {{name: node-{}, address: {}, mac: \"{mac}\", labels: {{lab: \"yes\"}}}}\n", i + 1, heartbeat_addr(i));
        } else {
            y += &format!("  - {{name: node-{}, address: {}, labels: {{lab: \"yes\"}}}}\n", i + 1, node_addr(i));
        }
    }
    let ranges: Vec<String> =
        (0..s.vips.div_ceil(VIPS_PER_NET)).map(|i| format!("{}-{}", vip(i * VIPS_PER_NET), vip(((i + 1) * VIPS_PER_NET).min(s.vips) - 1))).collect();
    let mut ranges: Vec<String> = ranges;
    if s.ipv6 && s.vips > 0 {
        ranges.push(format!("'{}-{}'", vip6(0), vip6(s.vips - 1)));
    }
    let announce = match &s.bgp {
        Some(b) if b.communities.is_empty() => "\n    announce: bgp".to_owned(),
        Some(b) => {
            format!("\n    announce: bgp\n    bgp: {{communities: [{}]}}", b.communities.iter().map(|c| format!("'{c}'")).collect::<Vec<_>>().join(", "))
        }
        None if s.lo_everywhere => "\n    announce: lo\n    distribution: all".to_owned(),
        None => String::new(),
    };
    y += &format!("pools:\n  - name: lab\n    addresses: [{}]\n    nodeSelector: {{lab: \"yes\"}}{announce}\nservices:\n", ranges.join(", "));
    let ports: Vec<String> = s.ports.iter().map(u16::to_string).collect();
    let table = s.table_size.map(|t| format!(", tableSize: {t}")).unwrap_or_default();
    let check = if s.health_check {
        format!(
            ", healthCheck: {{type: http, {}path: /healthz, interval: {}ms, timeout: {}ms, rise: 2, fall: {}}}",
            s.health_port.map(|p| format!("port: {p}, ")).unwrap_or_default(),
            s.check_interval_ms,
            s.check_interval_ms / 2,
            s.check_fall
        )
    } else {
        String::new()
    };
    let mut primes = (251u32..).filter(|n| (2..*n).take_while(|d| d * d <= *n).all(|d| n % d != 0));
    for k in 0..s.vips {
        let table = if s.distinct_tables { format!(", tableSize: {}", primes.next().expect("primes")) } else { table.clone() };
        y += &format!("  - {{name: web-{k}, vip: {}, ports: [{}]{table}{check}}}\n", vip(k), ports.join(", "));
        if s.ipv6 {
            y += &format!("  - {{name: web6-{k}, vip: '{}', ports: [{}]{table}{check}}}\n", vip6(k), ports.join(", "));
        }
    }
    if !s.default_timers {
        y += &format!("announce:\n  holdTime: {}ms\n  garpCount: 3\n  garpInterval: 50ms\n", s.hold_ms);
        y += &format!("failover:\n  heartbeatInterval: {}ms\n  deadAfter: {}ms\n", s.heartbeat_ms, s.dead_after_ms);
    }
    if let Some(b) = &s.bgp {
        y += &b.section();
    }
    y
}

/// Serves `name` on `port` forever. An HTTP request (`GET ...`) gets the name as
/// the body (curl, the agents' HTTP health checks); any other first line gets
/// "name\n" and then every further line echoed back (long-lived connections prove
/// they still reach the same backend).
pub fn serve_name(port: u16, name: &str) -> Result<()> {
    // One socket for both families (the dual-stack lab's IPv6 VIPs too).
    let s = socket2::Socket::new(socket2::Domain::IPV6, socket2::Type::STREAM, None)?;
    s.set_only_v6(false)?;
    s.set_reuse_address(true)?;
    s.bind(&SocketAddr::from((Ipv6Addr::UNSPECIFIED, port)).into()).with_context(|| format!("binding port {port}"))?;
    s.listen(1024)?;
    serve_name_on(s.into(), name)
}

/// [`serve_name`] on a listener already bound (in another namespace, say).
pub fn serve_name_on(l: TcpListener, name: &str) -> Result<()> {
    for conn in l.incoming() {
        let Ok(mut s) = conn else { continue };
        let name = name.to_owned();
        std::thread::spawn(move || {
            let _ = s.set_read_timeout(Some(Duration::from_secs(600)));
            let mut r = BufReader::new(s.try_clone().expect("clone stream"));
            let mut line = String::new();
            if !matches!(r.read_line(&mut line), Ok(n) if n > 0) {
                return;
            }
            if line.starts_with("GET ") {
                let _ = write!(s, "HTTP/1.0 200 OK\r\nContent-Type: text/plain\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{name}\n", name.len() + 1);
                return;
            }
            if writeln!(s, "{name}").is_err() {
                return;
            }
            line.clear();
            while matches!(r.read_line(&mut line), Ok(n) if n > 0) {
                if s.write_all(line.as_bytes()).is_err() {
                    break;
                }
                line.clear();
            }
        });
    }
    Ok(())
}

/// Sends the greeting line and reads the backend's name.
pub(crate) fn hello(s: &TcpStream, r: &mut BufReader<TcpStream>) -> Result<String> {
    (&*s).write_all(b"hello\n")?;
    let mut name = String::new();
    r.read_line(&mut name)?;
    if name.is_empty() {
        bail!("closed without naming its backend");
    }
    Ok(name.trim().to_owned())
}

/// A client connection through a VIP that stays open.
pub struct LongConn {
    pub backend: String,
    pub sport: u16,
    r: BufReader<TcpStream>,
    w: TcpStream,
}

impl LongConn {
    /// Connects from the client namespace (the socket stays in it) from `sport`.
    pub fn open(client: &NetNs, vip: impl Into<IpAddr>, sport: u16, timeout: Duration) -> Result<Self> {
        let vip = vip.into();
        Self::open_from(client, client_addr(vip), vip, sport, timeout)
    }

    /// [`Self::open`] from address `from` of `client` (a client behind a router).
    pub fn open_from(client: &NetNs, from: IpAddr, vip: impl Into<IpAddr>, sport: u16, timeout: Duration) -> Result<Self> {
        let vip = vip.into();
        let s = client.run(move || connect_from(from, sport, vip, timeout))??;
        s.set_read_timeout(Some(Duration::from_secs(3)))?;
        let mut r = BufReader::new(s.try_clone()?);
        let backend = hello(&s, &mut r)?;
        let sport = s.local_addr()?.port();
        Ok(Self { backend, sport, r, w: s })
    }

    /// One round trip on the open connection.
    pub fn ping(&mut self) -> Result<()> {
        self.w.write_all(b"ping\n")?;
        let mut line = String::new();
        self.r.read_line(&mut line)?;
        if line != "ping\n" {
            bail!("connection from port {} to {}: got {line:?}", self.sport, self.backend);
        }
        Ok(())
    }
}

/// The lab client's address of `vip`'s family.
fn client_addr(vip: IpAddr) -> IpAddr {
    match vip {
        IpAddr::V4(_) => CLIENT.into(),
        IpAddr::V6(_) => CLIENT6.into(),
    }
}

fn connect_from(from: IpAddr, sport: u16, vip: IpAddr, timeout: Duration) -> Result<TcpStream> {
    let domain = if vip.is_ipv4() { socket2::Domain::IPV4 } else { socket2::Domain::IPV6 };
    let s = socket2::Socket::new(domain, socket2::Type::STREAM, None)?;
    s.set_reuse_address(true)?;
    s.bind(&SocketAddr::from((from, sport)).into())?;
    s.connect_timeout(&SocketAddr::from((vip, SERVICE_PORT)).into(), timeout)?;
    Ok(s.into())
}

/// One short connection: the name of the backend that answered.
pub fn ask(client: &NetNs, vip: impl Into<IpAddr>, sport: u16, timeout: Duration) -> Result<String> {
    let vip = vip.into();
    ask_from(client, client_addr(vip), vip, sport, timeout)
}

/// [`ask`] from address `from` of `client` (a client behind a router).
pub fn ask_from(client: &NetNs, from: IpAddr, vip: IpAddr, sport: u16, timeout: Duration) -> Result<String> {
    let s = client.run(move || connect_from(from, sport, vip, timeout))??;
    s.set_read_timeout(Some(timeout.max(Duration::from_millis(500))))?;
    let mut r = BufReader::new(s.try_clone()?);
    hello(&s, &mut r)
}

pub struct HaNode {
    pub name: String,
    pub ns: NetNs,
    pub addr: IpAddr,
    pub mac: [u8; 6],
    pub agent: Option<AgentProc>,
    pub server: Option<Child>,
    /// The health server of [`HaSpec::health_port`].
    pub health_server: Option<Child>,
    pub pins: PinDir,
    pub status_file: PathBuf,
    pub log: PathBuf,
    /// The binary the node's agent starts from next; None: this build's.
    pub agent_bin: Option<PathBuf>,
}

pub struct HaLab {
    // Drop order: agents and servers (in nodes) first, the segment last.
    pub nodes: Vec<HaNode>,
    pub client: NetNs,
    pub seg: Segment,
    /// The heartbeat network of [`HaSpec::heartbeat_net`].
    pub hb_seg: Option<Segment>,
    pub spec: HaSpec,
    pub dir: PathBuf,
    pub config: PathBuf,
    /// Where the nodes' pin directories are.
    pins_root: PathBuf,
    /// The program the nodes' servers run (`serve NAME PORT`).
    server_exe: PathBuf,
    /// Remove `dir` and `pins_root` on Drop (tests); the persistent lab keeps them until `down`.
    remove_dir: bool,
}

/// GET `path` from the agent's HTTP port (127.0.0.1:9472) in the calling
/// thread's namespace; "" when it does not answer.
pub fn agent_http(path: &str) -> String {
    http_get("127.0.0.1:9472", path)
}

/// GET `path` from `addr` in the calling thread's namespace (HTTP/1.0: the whole
/// body, never chunked), head and body; "" when it does not answer.
pub fn http_get(addr: &str, path: &str) -> String {
    use std::io::Read;
    let Ok(mut s) = TcpStream::connect(addr) else { return String::new() };
    let _ = s.set_read_timeout(Some(Duration::from_secs(10)));
    let _ = write!(s, "GET {path} HTTP/1.0\r\nHost: x\r\n\r\n");
    let mut out = String::new();
    let _ = s.read_to_string(&mut out);
    out
}

/// The value of the sample `series` (name and labels exactly, e.g.
/// `vip_heartbeats_rejected_total{reason="stale"}`) in a scrape.
pub fn metric(text: &str, series: &str) -> Option<f64> {
    text.lines().find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.trim().parse().ok())
}

/// The sum and the largest of the samples of a family (every label set).
pub fn metric_sum_max(text: &str, family: &str) -> (f64, f64) {
    let v: Vec<f64> = text
        .lines()
        .filter(|l| l.strip_prefix(family).is_some_and(|r| r.starts_with(' ') || r.starts_with('{')))
        .filter_map(|l| l.rsplit(' ').next()?.parse().ok())
        .collect();
    (v.iter().sum(), v.iter().copied().fold(0.0, f64::max))
}

/// Threads scraping every node's `/metrics` every `every` until `stop`: a load of
/// scrapes on the agents. Each returns how many scrapes answered.
pub fn scrape_every(lab: &HaLab, every: Duration, stop: &std::sync::Arc<std::sync::atomic::AtomicBool>) -> Vec<std::thread::JoinHandle<u32>> {
    lab.nodes
        .iter()
        .map(|n| {
            let stop = stop.clone();
            n.ns.spawn(move || {
                let mut ok = 0u32;
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    if agent_http("/metrics").contains("vip_xdp_packets") {
                        ok += 1;
                    }
                    std::thread::sleep(every);
                }
                ok
            })
            .expect("a scraper thread in the node's namespace")
        })
        .collect()
}

/// The lab's heartbeat key file, in its directory.
pub const HEARTBEAT_KEY: &str = "heartbeat.key";

/// 32 random bytes as hex: a heartbeat key.
pub fn random_key() -> String {
    let mut b = [0u8; 32];
    // SAFETY: writes at most b.len() bytes into b.
    let n = unsafe { libc::getrandom(b.as_mut_ptr().cast(), b.len(), 0) };
    assert_eq!(n, 32, "getrandom");
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// Namespace names: unique per process for tests, fixed for the persistent lab.
pub enum Naming {
    Unique,
    Fixed,
}

pub const FIXED_PREFIX: &str = "vlab-";
pub const FIXED_DIR: &str = "/run/vip-lab";
pub const FIXED_PINS: &str = "/sys/fs/bpf/vip-lab";

impl HaLab {
    /// Builds the lab and starts every node's server and agent. `server_exe` is a
    /// program that runs `serve_name` when called as `server_exe serve NAME PORT`.
    pub fn start(spec: HaSpec, naming: Naming, server_exe: &Path) -> Result<Self> {
        let mut lab = Self::build(spec, naming, server_exe)?;
        if let Some(pod) = &lab.spec.in_cluster {
            // kube-proxy runs before the pods that reach the API through it.
            for n in &lab.nodes {
                pod.program_kube_proxy(&n.ns)?;
            }
        }
        for i in 0..lab.nodes.len() {
            lab.start_agent(i)?;
        }
        Ok(lab)
    }

    /// Builds the lab and starts every node's server, but no agent: the caller
    /// starts them ([`Self::start_agent`]) once what they need (an API server) is up.
    pub fn build(spec: HaSpec, naming: Naming, server_exe: &Path) -> Result<Self> {
        type Layout = (Box<dyn Fn(&str) -> String>, PathBuf, PathBuf, bool);
        let (ns_name, dir, pins_root, remove_dir): Layout = match naming {
            Naming::Unique => {
                let tag = unique("");
                (
                    Box::new(move |n: &str| format!("vh{n}{tag}")),
                    std::env::temp_dir().join(unique("vip-ha-lab-")),
                    PathBuf::from("/sys/fs/bpf").join(unique("vip-ha-")),
                    true,
                )
            }
            Naming::Fixed => (Box::new(|n: &str| format!("{FIXED_PREFIX}{n}")), FIXED_DIR.into(), FIXED_PINS.into(), false),
        };
        std::fs::create_dir_all(&dir)?;
        let config = dir.join("vip.yaml");
        write_atomic(&config, &ha_config(&spec))?;
        // The lab's heartbeat key: every agent signs and checks heartbeats with it.
        write_atomic(&dir.join(HEARTBEAT_KEY), &format!("{}\n", random_key()))?;
        anyhow::ensure!(spec.ipv6 || !spec.ipv6_only, "HaSpec: ipv6_only needs ipv6");
        let v4 = !spec.ipv6_only;
        let seg = Segment::in_ns(NetNs::create(ns_name("br"))?)?;
        let client = seg.plug(NetNs::create(ns_name("cl"))?, &if v4 { format!("{CLIENT}/24") } else { format!("{CLIENT6}/64") })?;
        if spec.ipv6 && v4 {
            client.ip(&["-6", "addr", "add", &format!("{CLIENT6}/64"), "dev", "eth0", "nodad"])?;
        }
        // VIPs are on-link for the client: it ARPs for them on the segment.
        for net in vip_nets(spec.vips).iter().filter(|_| v4) {
            client.ip(&["route", "add", net, "dev", "eth0"])?;
        }
        let hb_seg = if spec.heartbeat_net { Some(Segment::in_ns(NetNs::create(ns_name("hb"))?)?) } else { None };
        let mut nodes = Vec::new();
        for i in 0..spec.nodes {
            let name = format!("node-{}", i + 1);
            let mut addr = if v4 { IpAddr::V4(node_addr(i)) } else { IpAddr::V6(node_addr6(i)) };
            let ns = seg.plug(NetNs::create(ns_name(&format!("n{}", i + 1)))?, &if v4 { format!("{addr}/24") } else { format!("{addr}/64") })?;
            let ns = match &hb_seg {
                Some(hb) => {
                    ns.ip(&["link", "set", "eth0", "address", &uplink_mac(i).map(|b| format!("{b:02x}")).join(":")])?;
                    addr = heartbeat_addr(i).into();
                    hb.plug_as(ns, "eth1", &format!("{addr}/24"))?
                }
                None => ns,
            };
            if spec.ipv6 && v4 {
                ns.ip(&["-6", "addr", "add", &format!("{}/64", node_addr6(i)), "dev", "eth0", "nodad"])?;
            }
            if spec.ipv6 && spec.lo_everywhere {
                // Accepted by a local route, as the IPv4 ones below.
                ns.ip(&["-6", "route", "replace", "local", VIP6_NET, "dev", "lo"])?;
            } else if spec.ipv6 {
                // As a backend: the VIP on lo (Linux answers solicitations only for
                // the receiving interface's addresses: no arp_ignore to set).
                // One `ip -batch` for all of them (a thousand `ip` runs take seconds).
                let batch = dir.join(format!("lo6-{i}.batch"));
                std::fs::write(&batch, (0..spec.vips).map(|k| format!("addr add {}/128 dev lo\n", vip6(k))).collect::<String>())?;
                ns.ip(&["-batch", path_str(&batch)?])?;
            }
            if !v4 {
                // IPv6-only: no IPv4 VIP to accept.
            } else if spec.lo_everywhere {
                // Accepted by local routes: `lo` holds only the agent's VIPs, which
                // the node's routing daemon announces.
                for net in vip_nets(spec.vips) {
                    ns.ip(&["route", "replace", "local", &net, "dev", "lo"])?;
                }
            } else if spec.vips <= VIPS_PER_NET {
                for k in 0..spec.vips {
                    accept_vip(&ns, vip(k))?;
                }
            } else {
                // Many VIPs: local routes accept whole /24s in one command each.
                accept_vip(&ns, vip(0))?;
                for net in vip_nets(spec.vips) {
                    ns.ip(&["route", "replace", "local", &net, "dev", "lo"])?;
                }
            }
            let mac = ns.mac("eth0")?;
            let pins = PinDir::at(pins_root.join(&name))?;
            let (status_file, log) = (dir.join(format!("{name}.status.json")), dir.join(format!("{name}.log")));
            let server = spawn_server(&ns, server_exe, &name, SERVICE_PORT)?;
            let health_server = spec.health_port.map(|p| spawn_server(&ns, server_exe, &name, p)).transpose()?;
            nodes.push(HaNode {
                name,
                ns,
                addr,
                mac,
                agent: None,
                server: Some(server),
                health_server,
                pins,
                status_file,
                log,
                agent_bin: spec.agent_bin.clone(),
            });
        }
        let server_exe = server_exe.to_owned();
        let mut lab = Self { nodes, client, seg, hb_seg, spec, dir, config, pins_root, server_exe, remove_dir };
        if lab.spec.ipv6 {
            // Links that have been up a while, as a node's are: each host's
            // link-local address past duplicate address detection, so that its MLD
            // reports (the agents' solicited-node groups) come from that address,
            // which a snooping bridge learns groups from.
            for ns in lab.nodes.iter().map(|n| &n.ns).chain([&lab.client]) {
                let settled = wait_for(Duration::from_secs(5), || {
                    let o = ns.ip(&["-6", "addr", "show", "dev", "eth0", "tentative"]).ok()?;
                    o.stdout.is_empty().then_some(())
                });
                settled.with_context(|| format!("{}: eth0's IPv6 addresses still tentative after 5 s", ns.name))?;
            }
        }
        // Servers listening before anything is measured: the agents count a new
        // backend healthy until its checks fail, so full rings do not prove it.
        // (On failure the lab is dropped: servers killed, directories removed.)
        for i in 0..lab.nodes.len() {
            lab.wait_listening(i, SERVICE_PORT)?;
            if let Some(p) = lab.spec.health_port {
                lab.wait_listening(i, p)?;
            }
        }
        Ok(lab)
    }

    /// Waits until node `i`'s server of `port` (its name server or its health server) listens.
    fn wait_listening(&mut self, i: usize, port: u16) -> Result<()> {
        let n = &mut self.nodes[i];
        let listening = n.ns.run(move || wait_for(Duration::from_secs(10), || TcpStream::connect((Ipv4Addr::LOCALHOST, port)).ok()))?;
        if listening.is_none() {
            let server = if port == SERVICE_PORT { n.server.as_mut() } else { n.health_server.as_mut() };
            let exited = server.and_then(|s| s.try_wait().ok().flatten());
            bail!("{}'s server ({}) is not listening on port {port} (exited: {exited:?})", n.name, self.server_exe.display());
        }
        Ok(())
    }

    /// Stops node `i`'s health server ([`HaSpec::health_port`]): its checks fail
    /// while the node, its agent and its name server run on.
    pub fn stop_health(&mut self, i: usize) {
        if let Some(mut s) = self.nodes[i].health_server.take() {
            let _ = s.kill();
            let _ = s.wait();
        }
    }

    /// Starts node `i`'s health server again, and waits until it listens.
    pub fn start_health(&mut self, i: usize) -> Result<()> {
        let port = self.spec.health_port.context("HaSpec::health_port is not set")?;
        let n = &mut self.nodes[i];
        n.health_server = Some(spawn_server(&n.ns, &self.server_exe, &n.name, port)?);
        self.wait_listening(i, port)
    }

    /// Node `i` powered off (the first half of a reboot): its link down, then its
    /// agent, its servers (the connections they carried) and its data path gone
    /// (`vip-agent cleanup`: the program detached, every pin removed, as a
    /// reboot empties bpffs).
    pub fn power_off(&mut self, i: usize) -> Result<()> {
        self.seg.cable(&self.nodes[i].ns, false)?;
        self.kill_agent(i);
        let n = &mut self.nodes[i];
        for mut s in [n.server.take(), n.health_server.take()].into_iter().flatten() {
            let _ = s.kill();
            let _ = s.wait();
        }
        let bin = match &n.agent_bin {
            Some(b) => b.clone(),
            None => crate::agent::agent_bin()?,
        };
        let o = n.ns.cmd(path_str(&bin)?).args(["--pin-dir", path_str(&n.pins.path)?, "cleanup", "--status-file", path_str(&n.status_file)?]).output()?;
        ensure!(o.status.success(), "{}: vip-agent cleanup failed: {}", n.name, String::from_utf8_lossy(&o.stderr));
        self.record_pids();
        Ok(())
    }

    /// Node `i` back from [`Self::power_off`]: its link up, its servers started
    /// (listening), its agent started on an empty pin directory.
    pub fn power_on(&mut self, i: usize) -> Result<()> {
        self.seg.cable(&self.nodes[i].ns, true)?;
        let n = &mut self.nodes[i];
        n.server = Some(spawn_server(&n.ns, &self.server_exe, &n.name, SERVICE_PORT)?);
        if let Some(p) = self.spec.health_port {
            n.health_server = Some(spawn_server(&n.ns, &self.server_exe, &n.name, p)?);
        }
        self.wait_listening(i, SERVICE_PORT)?;
        if let Some(p) = self.spec.health_port {
            self.wait_listening(i, p)?;
        }
        self.start_agent(i)
    }

    /// Node `i`'s FRR directory ([`HaSpec::bgp`]): its daemons' sockets and
    /// the integrated configuration its agent writes.
    pub fn frr_dir(&self, i: usize) -> PathBuf {
        self.dir.join(format!("frr-{}", self.nodes[i].name))
    }

    /// Starts (or restarts) node `i`'s agent, appending to its log.
    pub fn start_agent(&mut self, i: usize) -> Result<()> {
        let config = self.config.clone();
        self.start_agent_with(i, &config)
    }

    /// [`Self::start_agent`] reading `config` instead of the lab's shared file
    /// (file mode only).
    pub fn start_agent_with(&mut self, i: usize, config: &Path) -> Result<()> {
        let frr = self.spec.bgp.is_some().then(|| self.frr_dir(i));
        let frr_config = frr.as_ref().map(|d| d.join("frr.conf"));
        let n = &mut self.nodes[i];
        let mode = mode_arg(self.spec.xdp_mode, &format!("{}'s agent", n.name));
        let metrics_addr = if self.spec.metrics_on_segment {
            crate::daemonset::AgentPod::load()?.arg("--metrics-addr").context("deploy/20-daemonset.yaml: no --metrics-addr")?.to_owned()
        } else {
            "127.0.0.1:9472".to_owned()
        };
        let mut args = vec![
            "--node-name",
            &n.name,
            "--iface",
            "eth0",
            "--mode",
            mode,
            "--pin-dir",
            path_str(&n.pins.path)?,
            "--status-file",
            path_str(&n.status_file)?,
            "--reload-interval",
            "200ms",
            "--metrics-addr",
            &metrics_addr,
        ];
        let key = self.dir.join(HEARTBEAT_KEY);
        args.extend(["--heartbeat-key-file", path_str(&key)?]);
        let capacity = self.spec.ring_capacity.map(|c| c.to_string());
        if let Some(c) = &capacity {
            args.extend(["--ring-capacity", c]);
        }
        let arp_check = self.spec.arp_check_ms.map(|ms| format!("{ms}ms"));
        if let Some(a) = &arp_check {
            args.extend(["--arp-check-interval", a]);
        }
        if let (Some(dir), Some(config)) = (&frr, &frr_config) {
            args.extend(["--frr-config", path_str(config)?, "--frr-vty-dir", path_str(dir)?]);
        }
        let kubeconfig = self.spec.kubeconfig.as_deref().map(path_str).transpose()?;
        match (&self.spec.in_cluster, kubeconfig) {
            (Some(_), _) => args.push("--kubernetes"),
            (None, Some(k)) => args.extend(["--kubernetes", "--kubeconfig", k]),
            (None, None) => args.extend(["--config", path_str(config)?]),
        }
        let bin = match &n.agent_bin {
            Some(b) => b.clone(),
            None => crate::agent::agent_bin()?,
        };
        n.agent = Some(match &self.spec.in_cluster {
            Some(pod) => AgentProc::start_in_pod(&n.ns, &bin, pod, &args, &n.log)?,
            None => AgentProc::start_appending(&n.ns, &bin, &args, &n.log)?,
        });
        self.record_pids();
        Ok(())
    }

    /// A fixed-named lab's "NODE agent|server PID" lines (its `pids` file), kept
    /// current as agents stop and start, for `lab status` (up or down) and
    /// `lab down` (what to kill).
    fn record_pids(&self) {
        if self.remove_dir {
            return;
        }
        let pids: Vec<String> = self
            .nodes
            .iter()
            .flat_map(|n| {
                let a = n.agent.iter().map(|a| format!("{} agent {}", n.name, a.child.id()));
                a.chain(n.server.iter().map(|s| format!("{} server {}", n.name, s.id())))
            })
            .collect();
        let _ = write_atomic(&self.dir.join("pids"), &pids.join("\n"));
    }

    /// SIGKILLs node `i`'s agent and reaps it (the data path keeps running).
    pub fn kill_agent(&mut self, i: usize) {
        self.stop_agent(i, libc::SIGKILL);
    }

    /// Sends `sig` (SIGTERM: a clean stop; SIGKILL) to node `i`'s agent and reaps
    /// it; killed if it has not exited within 5 s. The data path keeps running.
    pub fn stop_agent(&mut self, i: usize, sig: i32) {
        self.stop_agent_within(i, sig, Duration::from_secs(5));
    }

    /// [`Self::stop_agent`], killing it (SIGKILL) once `limit` has passed; how long
    /// it took to be reaped.
    pub fn stop_agent_within(&mut self, i: usize, sig: i32, limit: Duration) -> Duration {
        let t = Instant::now();
        if let Some(mut a) = self.nodes[i].agent.take() {
            a.signal(sig);
            if wait_for(limit, || a.child.try_wait().ok().flatten()).is_none() {
                let _ = a.child.kill();
            }
            let _ = a.child.wait();
        }
        self.record_pids();
        t.elapsed()
    }

    pub fn signal_agent(&self, i: usize, sig: i32) {
        if let Some(a) = &self.nodes[i].agent {
            a.signal(sig);
        }
    }

    /// Node `i`'s agent status (the agent's own type, read from its status file).
    pub fn status(&self, i: usize) -> Option<Status> {
        serde_json::from_str(&std::fs::read_to_string(&self.nodes[i].status_file).ok()?).ok()
    }

    /// Node `i`'s agent's `/metrics`.
    pub fn metrics(&self, i: usize) -> String {
        self.nodes[i].ns.run(|| agent_http("/metrics")).unwrap_or_default()
    }

    /// IPv4 VIP → owner as node `i` sees it.
    pub fn owners_seen_by(&self, i: usize) -> Option<BTreeMap<Ipv4Addr, String>> {
        Some(owners4(&self.status(i)?))
    }

    /// The owner of `vip` (either family) as node `i` sees it.
    pub fn owner_seen_by(&self, i: usize, vip: IpAddr) -> Option<String> {
        self.status(i)?.owners.remove(&vip)
    }

    /// The IPv4 VIPs node `i` holds.
    pub fn held_by(&self, i: usize) -> Vec<Ipv4Addr> {
        self.status(i).map(|s| held4(&s)).unwrap_or_default()
    }

    /// Waits until the nodes in `up` agree on owners, each VIP is owned by one of
    /// them and held by exactly its owner (by all of them with
    /// [`HaSpec::lo_everywhere`]); returns the owners.
    pub fn wait_converged(&self, up: &[usize], limit: Duration) -> Result<BTreeMap<Ipv4Addr, String>> {
        self.wait_converged_on(up, self.spec.vips, limit)
    }

    /// [`Self::wait_converged`] with `vips` VIPs owned (in Kubernetes mode only the
    /// allocated addresses of a pool are).
    pub fn wait_converged_on(&self, up: &[usize], vips: usize, limit: Duration) -> Result<BTreeMap<Ipv4Addr, String>> {
        let names: Vec<&str> = up.iter().map(|&i| self.nodes[i].name.as_str()).collect();
        let r = wait_for(limit, || {
            // Each status read once a round: a dual-stack lab's checks below look
            // at every IPv6 VIP in every node's status.
            let statuses: Vec<Status> = up.iter().map(|&i| self.status(i)).collect::<Option<Vec<_>>>()?;
            let views: Vec<BTreeMap<Ipv4Addr, String>> = statuses.iter().map(owners4).collect();
            let first = views[0].clone();
            if first.len() != vips || views.iter().any(|v| *v != first) || first.values().any(|o| !names.contains(&o.as_str())) {
                return None;
            }
            for (&i, st) in up.iter().zip(&statuses) {
                // `lo_everywhere`: every node holds every VIP.
                let mine = |o: &String| self.spec.lo_everywhere || *o == self.nodes[i].name;
                let mut want: Vec<Ipv4Addr> = first.iter().filter(|(_, o)| mine(o)).map(|(v, _)| *v).collect();
                want.sort();
                if held4(st) != want {
                    return None;
                }
            }
            // The dual-stack lab's IPv6 twins: one owner that all agree on, holding it.
            if self.spec.ipv6 {
                for k in 0..vips {
                    let v = IpAddr::V6(vip6(k));
                    let owner = statuses[0].owners.get(&v)?;
                    let at = up.iter().position(|&i| self.nodes[i].name == *owner)?;
                    if statuses.iter().any(|st| st.owners.get(&v) != Some(owner)) || !statuses[at].held.contains(&v) {
                        return None;
                    }
                }
            }
            Some(first)
        });
        r.with_context(|| {
            let views: Vec<String> = up.iter().map(|&i| format!("{}: {:?} holds {:?}", self.nodes[i].name, self.owners_seen_by(i), self.held_by(i))).collect();
            format!("no agreement among {names:?} within {limit:?}:\n{}", views.join("\n"))
        })
    }

    /// Waits until the nodes in `up` agree on one owner among them for each of
    /// `vips` (either family) and that owner alone holds it; returns the owners.
    pub fn wait_held(&self, up: &[usize], vips: &[IpAddr], limit: Duration) -> Result<BTreeMap<IpAddr, String>> {
        let r = wait_for(limit, || {
            let statuses: Vec<Status> = up.iter().map(|&i| self.status(i)).collect::<Option<Vec<_>>>()?;
            let mut owners = BTreeMap::new();
            for v in vips {
                let owner = statuses[0].owners.get(v)?;
                let at = up.iter().position(|&i| self.nodes[i].name == *owner)?;
                let agreed = statuses.iter().all(|st| st.owners.get(v) == Some(owner));
                let held_by: Vec<usize> = (0..up.len()).filter(|&j| statuses[j].held.contains(v)).collect();
                if !agreed || held_by != [at] {
                    return None;
                }
                owners.insert(*v, owner.clone());
            }
            Some(owners)
        });
        r.with_context(|| {
            let views: Vec<String> = up.iter().map(|&i| format!("{}: {:?}", self.nodes[i].name, self.status(i).map(|s| (s.owners, s.held)))).collect();
            format!("{vips:?}: no agreement among {up:?} within {limit:?}:\n{}", views.join("\n"))
        })
    }

    /// Waits until every node in `up` has every backend healthy and in every ring:
    /// all rings equal again (after a node came back, each agent re-admits it after
    /// its own `rise` probes).
    pub fn wait_rings_full(&self, up: &[usize], limit: Duration) -> Result<()> {
        let r = wait_for(limit, || {
            up.iter()
                .all(|&i| {
                    self.status(i).is_some_and(|s| {
                        let full = s.services.len() == self.spec.vips * self.spec.ports.len() * (1 + usize::from(self.spec.ipv6))
                            && s.services.iter().all(|x| x.backends.len() == self.nodes.len());
                        full && s.health.iter().all(|x| x.healthy)
                    })
                })
                .then_some(())
        });
        r.with_context(|| format!("rings not full within {limit:?}"))
    }

    pub fn index_of(&self, name: &str) -> usize {
        self.nodes.iter().position(|n| n.name == name).expect("node name")
    }

    /// The client's neighbour entry for `ip`: its MAC, if it has one.
    pub fn client_neigh(&self, ip: impl Into<IpAddr>) -> Option<[u8; 6]> {
        let ip = ip.into();
        let o = self.client.ip(&["neigh", "show", &ip.to_string()]).ok()?;
        let text = String::from_utf8_lossy(&o.stdout);
        let mac = text.split_whitespace().skip_while(|w| *w != "lladdr").nth(1)?;
        let b: Vec<u8> = mac.split(':').filter_map(|x| u8::from_str_radix(x, 16).ok()).collect();
        b.try_into().ok()
    }

    pub fn agent_logs(&self) -> String {
        self.nodes.iter().map(|n| format!("--- {}:\n{}", n.name, std::fs::read_to_string(&n.log).unwrap_or_default())).collect()
    }

    /// Leaves the lab running after this process exits (`cargo xtask lab up`):
    /// nothing is removed on Drop; `down` removes it by its fixed names.
    pub fn persist(self) {
        self.record_pids();
        std::mem::forget(self);
    }
}

/// Removes a persistent lab: its processes, namespaces, pins and files.
pub fn down_fixed() -> Result<usize> {
    let dir = Path::new(FIXED_DIR);
    if let Ok(p) = std::fs::read_to_string(dir.join("pids")) {
        for pid in p.lines().filter_map(|l| l.split_whitespace().nth(2)?.parse::<i32>().ok()) {
            // SAFETY: plain kill(2); a pid that is gone just fails.
            unsafe { libc::kill(pid, libc::SIGKILL) };
        }
    }
    let list = sh(&["ip", "netns", "list"])?;
    let mut removed = 0;
    for name in String::from_utf8_lossy(&list.stdout).lines().filter_map(|l| l.split_whitespace().next()) {
        if name.starts_with(FIXED_PREFIX) {
            sh(&["ip", "netns", "del", name])?;
            removed += 1;
        }
    }
    let _ = std::fs::remove_dir_all(FIXED_PINS);
    let _ = std::fs::remove_dir_all(dir);
    Ok(removed)
}

impl Drop for HaLab {
    fn drop(&mut self) {
        for n in &mut self.nodes {
            for mut s in [n.server.take(), n.health_server.take()].into_iter().flatten() {
                let _ = s.kill();
                let _ = s.wait();
            }
            if let Some(a) = &n.agent {
                a.signal(libc::SIGCONT); // a stopped agent cannot die otherwise
            }
        }
        // Agents killed and their PinDirs removed now, so the directories can go.
        drop(std::mem::take(&mut self.nodes));
        if self.remove_dir {
            let _ = std::fs::remove_dir_all(&self.dir);
            let _ = std::fs::remove_dir(&self.pins_root);
        }
    }
}

/// Runs `server_exe serve NAME PORT` ([`serve_name`]) in `ns`.
fn spawn_server(ns: &NetNs, server_exe: &Path, name: &str, port: u16) -> Result<Child> {
    ns.cmd(server_exe.to_str().context("server path")?)
        .args(["serve", name, &port.to_string()])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .with_context(|| format!("starting the server of port {port}"))
}

fn path_str(p: &Path) -> Result<&str> {
    p.to_str().context("non-UTF-8 path")
}

/// Polls until `f` holds, at most `limit`; returns how long it took.
pub fn time_until(limit: Duration, mut f: impl FnMut() -> bool) -> Option<Duration> {
    let t = Instant::now();
    wait_for(limit, || f().then_some(())).map(|_| t.elapsed())
}

/// One ARP frame seen: when, sender MAC, sender address.
pub type ArpSeen = (Instant, [u8; 6], Ipv4Addr);
/// One claim of an address seen: an ARP frame's sender, or a Neighbor
/// Advertisement's target with the frame's source MAC.
pub type NeighSeen = (Instant, [u8; 6], IpAddr);

/// ARP frames and Neighbor Advertisements seen on the client's eth0 (who claimed
/// which address, when), captured by a packet socket in the client namespace
/// until `stop`.
pub struct ArpWatch {
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    thread: Option<std::thread::JoinHandle<Vec<NeighSeen>>>,
}

/// A packet socket receiving every ARP frame in the calling thread's namespace
/// (sent and received), each `recv` waiting at most 20 ms.
pub fn arp_socket() -> std::io::Result<std::os::fd::OwnedFd> {
    packet_socket(vip_common::ETH_P_ARP)
}

/// [`arp_socket`] for frames of `ethertype` (ETH_P_ALL: every frame).
fn packet_socket(ethertype: u16) -> std::io::Result<std::os::fd::OwnedFd> {
    use std::os::fd::{AsRawFd, FromRawFd};
    // SAFETY: plain socket(2); the fd is owned below.
    let fd = unsafe { libc::socket(libc::AF_PACKET, libc::SOCK_RAW | libc::SOCK_CLOEXEC, i32::from(ethertype.to_be())) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: a fresh fd nobody else owns.
    let fd = unsafe { std::os::fd::OwnedFd::from_raw_fd(fd) };
    let tv = libc::timeval { tv_sec: 0, tv_usec: 20_000 };
    // SAFETY: valid fd and option of the stated size.
    unsafe {
        libc::setsockopt(fd.as_raw_fd(), libc::SOL_SOCKET, libc::SO_RCVTIMEO, (&tv as *const libc::timeval).cast(), std::mem::size_of::<libc::timeval>() as u32)
    };
    Ok(fd)
}

/// One ARP frame from `fd` (None on timeout or a runt): its opcode and the
/// sender's and target's hardware and protocol addresses.
pub fn recv_arp(fd: &std::os::fd::OwnedFd) -> Option<(u16, [u8; 6], Ipv4Addr, Ipv4Addr)> {
    use std::os::fd::AsRawFd;
    let mut buf = [0u8; 128];
    // SAFETY: valid fd and buffer.
    let n = unsafe { libc::recv(fd.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len(), 0) };
    (n >= 42).then(|| {
        let op = u16::from_be_bytes([buf[20], buf[21]]);
        let sha: [u8; 6] = buf[22..28].try_into().expect("6 bytes");
        (op, sha, Ipv4Addr::new(buf[28], buf[29], buf[30], buf[31]), Ipv4Addr::new(buf[38], buf[39], buf[40], buf[41]))
    })
}

/// One frame from `fd` (`flags` for recv(2)): None on a timeout or, with
/// MSG_DONTWAIT, when none is queued; else the address it claims and the MAC
/// claiming it, if it is an ARP frame (its sender) or an untagged Neighbor
/// Advertisement (its target).
fn recv_claim(fd: &std::os::fd::OwnedFd, flags: i32) -> Option<Option<([u8; 6], IpAddr)>> {
    use std::os::fd::AsRawFd;
    let mut buf = [0u8; 128];
    // SAFETY: valid fd and buffer.
    let n = unsafe { libc::recv(fd.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len(), flags) };
    let n = usize::try_from(n).ok()?;
    Some(match u16::from_be_bytes([buf[12], buf[13]]) {
        0x0806 if n >= 42 => buf[22..28].try_into().ok().map(|mac| (mac, Ipv4Addr::new(buf[28], buf[29], buf[30], buf[31]).into())),
        // IPv6, next header ICMPv6 (58), type 136; the target follows the flags word.
        0x86dd if n >= 78 && buf[20] == 58 && buf[54] == 136 => {
            let target: [u8; 16] = buf[62..78].try_into().ok()?;
            buf[6..12].try_into().ok().map(|mac| (mac, Ipv6Addr::from(target).into()))
        }
        _ => None,
    })
}

impl ArpWatch {
    pub fn start(client: &NetNs) -> Result<Self> {
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let flag = stop.clone();
        let (ready_tx, ready_rx) = std::sync::mpsc::channel();
        let thread = client.spawn(move || {
            let mut seen = Vec::new();
            let fd = packet_socket(libc::ETH_P_ALL as u16);
            let _ = ready_tx.send(fd.as_ref().map(|_| ()).map_err(|e| e.to_string()));
            let Ok(fd) = fd else { return seen };
            while !flag.load(std::sync::atomic::Ordering::Relaxed) {
                if let Some(Some((mac, addr))) = recv_claim(&fd, 0) {
                    seen.push((Instant::now(), mac, addr));
                }
            }
            // Frames queued before the stop but not read yet (this thread was
            // not scheduled meanwhile): the caller saw their effects already,
            // e.g. ping's answer came after the advertisement that let it send.
            // Bounded: a segment sending without pause cannot hold this forever.
            for _ in 0..100_000 {
                match recv_claim(&fd, libc::MSG_DONTWAIT) {
                    Some(Some((mac, addr))) => seen.push((Instant::now(), mac, addr)),
                    Some(None) => {}
                    None => break,
                }
            }
            seen
        })?;
        if let Err(e) = ready_rx.recv().context("the ARP capture thread")? {
            bail!("packet socket: {e}");
        }
        Ok(Self { stop, thread: Some(thread) })
    }

    /// Stops capturing; returns the ARP frames seen.
    pub fn finish(self) -> Vec<ArpSeen> {
        self.finish_all().into_iter().filter_map(|(t, mac, a)| Some((t, mac, v4(a)?))).collect()
    }

    /// Stops capturing; returns every claim seen (ARP and Neighbor Advertisements).
    pub fn finish_all(mut self) -> Vec<NeighSeen> {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        self.thread.take().and_then(|t| t.join().ok()).unwrap_or_default()
    }
}

/// Who claimed one VIP on the segment during an [`arp_probe`], as the client saw it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Claims {
    /// MACs that answered the client's requests.
    pub answered: BTreeSet<[u8; 6]>,
    /// MACs that sent gratuitous ARP for it.
    pub announced: BTreeSet<[u8; 6]>,
}

/// Asks the segment for each of `vips` from the client: `rounds` broadcast ARP
/// requests for every VIP, `gap` apart, and what came back until `gap` after the
/// last round. Much faster than one arping per VIP, and it also sees gratuitous
/// ARP from anyone claiming a VIP meanwhile.
pub fn arp_probe(client: &NetNs, vips: &[Ipv4Addr], rounds: u32, gap: Duration) -> Result<BTreeMap<Ipv4Addr, Claims>> {
    let mac = client.mac("eth0")?;
    let vips = vips.to_vec();
    client.run(move || -> Result<BTreeMap<Ipv4Addr, Claims>> {
        let fd = arp_socket().context("packet socket")?;
        let tx = vip_agent::ha::garp::GarpSocket::new().context("packet socket for sending")?;
        // SAFETY: a NUL-terminated name.
        let ifindex = unsafe { libc::if_nametoindex(c"eth0".as_ptr()) };
        if ifindex == 0 {
            bail!("no eth0 in the client namespace");
        }
        let mut claims: BTreeMap<Ipv4Addr, Claims> = vips.iter().map(|v| (*v, Claims::default())).collect();
        let mut next = Instant::now();
        let end = next + gap * rounds;
        for _ in 0..rounds {
            for v in &vips {
                tx.send_frame(ifindex, &vip_agent::ha::garp::arp_request_frame(mac, CLIENT, *v))?;
            }
            next += gap;
            while Instant::now() < next.min(end) {
                let Some((op, sha, spa, tpa)) = recv_arp(&fd) else { continue };
                let Some(c) = claims.get_mut(&spa).filter(|_| sha != mac) else { continue };
                match op {
                    2 if tpa == CLIENT => c.answered.insert(sha),
                    1 if tpa == spa => c.announced.insert(sha),
                    _ => false,
                };
            }
        }
        Ok(claims)
    })?
}

/// New connections to `vip` started every `every` for `span` from the client,
/// each with `timeout`, in the background: join for (start, when it succeeded)
/// per attempt, in start order.
pub type Probes = std::thread::JoinHandle<Vec<(Instant, Option<Instant>)>>;

pub fn spawn_probes(client: &NetNs, vip: impl Into<IpAddr>, every: Duration, span: Duration, timeout: Duration) -> Result<Probes> {
    let end = Instant::now() + span;
    crate::load::connect_loop(client, vec![vip.into()], every, timeout, move || Instant::now() < end)
}

/// What a client saw of one failover.
pub struct Outage {
    /// Fault → completion of the first new connection attempted after it.
    pub first_ok: Option<Duration>,
    /// New connections attempted after the fault that failed.
    pub failed: usize,
    /// Fault → first gratuitous ARP (or reply; for an IPv6 VIP a Neighbor
    /// Advertisement) for the VIP from a MAC other than the old owner's.
    pub takeover: Option<Duration>,
    pub conns: usize,
    /// Established connections that broke (a ping failed) during the window.
    pub broken: usize,
}

/// Watches a failover of `vip` from the client: long-lived connections kept busy
/// (a ping each every 50 ms), new connections tried every 10 ms for `span`, and
/// ARP frames captured. Start it, cause the fault, call `finish` with its instant.
pub struct FailoverWatch {
    vip: IpAddr,
    old_mac: [u8; 6],
    pinger: crate::load::Pinger,
    arp: ArpWatch,
    probes: Probes,
}

impl FailoverWatch {
    pub fn start(lab: &HaLab, vip: impl Into<IpAddr>, old_mac: [u8; 6], conns: Vec<LongConn>, span: Duration) -> Result<Self> {
        let vip = vip.into();
        let pinger = crate::load::Pinger::start(conns, Duration::from_millis(50));
        let arp = ArpWatch::start(&lab.client)?;
        let probes = spawn_probes(&lab.client, vip, Duration::from_millis(10), span, Duration::from_millis(150))?;
        Ok(Self { vip, old_mac, pinger, arp, probes })
    }

    /// Waits for the probes to end; returns the outage and the connections (with
    /// whether each broke). `t0`: when the fault command started; `done`: when it
    /// returned. Only connections started after `done` count as new, and times are
    /// taken from `t0` (conservative by the command's own duration).
    pub fn finish(self, t0: Instant, done: Instant) -> Result<(Outage, Vec<LongConn>, Vec<bool>)> {
        let attempts = self.probes.join().map_err(|_| anyhow::anyhow!("probe thread panicked"))?;
        let (conns, broken) = self.pinger.finish()?;
        let frames = self.arp.finish_all();
        let after: Vec<_> = attempts.iter().filter(|(s, _)| *s >= done).collect();
        let outage = Outage {
            first_ok: after.iter().find_map(|(_, d)| *d).map(|d| d.duration_since(t0)),
            failed: after.iter().filter(|(_, d)| d.is_none()).count(),
            takeover: frames.iter().find(|(t, sha, spa)| *t >= t0 && *spa == self.vip && *sha != self.old_mac).map(|(t, _, _)| t.duration_since(t0)),
            conns: conns.len(),
            broken: broken.iter().filter(|b| **b).count(),
        };
        Ok((outage, conns, broken))
    }
}

/// The owners of the IPv4 VIPs in a node's status.
fn owners4(s: &Status) -> BTreeMap<Ipv4Addr, String> {
    s.owners.iter().filter_map(|(v, o)| Some((v4(*v)?, o.clone()))).collect()
}

/// The IPv4 VIPs a node's status says it holds.
fn held4(s: &Status) -> Vec<Ipv4Addr> {
    s.held.iter().copied().filter_map(v4).collect()
}

fn v4(a: std::net::IpAddr) -> Option<Ipv4Addr> {
    match a {
        std::net::IpAddr::V4(v) => Some(v),
        std::net::IpAddr::V6(_) => None,
    }
}
