//! The one model of the world the agent acts on. The YAML file source
//! (`config`) fills it today; the Kubernetes source fills the same types.
use std::{collections::BTreeMap, net::IpAddr, time::Duration};

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// Label selector (matchLabels): every pair must be on the node; empty selects all.
pub type Selector = BTreeMap<String, String>;

pub fn selects(selector: &Selector, labels: &BTreeMap<String, String>) -> bool {
    selector.iter().all(|(k, v)| labels.get(k) == Some(v))
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Node {
    /// Stable identity: Maglev permutations and VIP ownership derive from it.
    pub name: String,
    /// IPv4 or IPv6: heartbeats, health checks and the backend's MAC use it.
    pub addr: IpAddr,
    /// Known MAC; `None` = resolved from the neighbour table at run time.
    pub mac: Option<[u8; 6]>,
    pub labels: BTreeMap<String, String>,
    /// NoSchedule/NoExecute taints (Kubernetes); a pool must tolerate them.
    pub taints: Vec<Taint>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Taint {
    pub key: String,
    pub value: String,
    pub effect: String,
}

/// A pool's toleration, with Kubernetes semantics (operator Equal or Exists; an
/// empty key with Exists tolerates everything; an empty effect matches all effects).
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Toleration {
    pub key: String,
    pub exists: bool,
    pub value: String,
    pub effect: String,
}

impl Toleration {
    pub fn tolerates(&self, t: &Taint) -> bool {
        (self.effect.is_empty() || self.effect == t.effect)
            && (self.key.is_empty() && self.exists || self.key == t.key && (self.exists || self.value == t.value))
    }
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Pool {
    pub name: String,
    /// Every address of the pool (ranges and CIDRs expanded, exclusions removed), sorted.
    pub addresses: Vec<IpAddr>,
    /// Nodes that may hold (answer ARP for) this pool's VIPs.
    pub node_selector: Selector,
    /// Taints of such nodes that do not make them ineligible.
    pub tolerations: Vec<Toleration>,
    /// How the holder of one of its VIPs draws the VIP's traffic.
    pub announce: AnnounceMode,
    /// Which eligible nodes hold each VIP: one, or (`announce: lo`) all of them.
    pub distribution: Distribution,
    /// Its own gratuitous ARP settings; `None`: the world's (`Announce::garp`).
    pub garp: Option<Garp>,
    /// Interfaces of a node where its VIPs are answered: the first one the node has
    /// (names differ between nodes). Empty: chosen by address (`links::resolve`).
    pub interfaces: Vec<String>,
    /// The 802.1Q VLAN (1..=4094) of that interface its VIPs live on, without a
    /// VLAN sub-interface on the node; None: untagged (or the sub-interface's).
    pub vlan: Option<u16>,
    /// What its routes carry (`announce: bgp`).
    pub bgp: crate::bgp::Attributes,
}

impl Pool {
    pub fn admits(&self, n: &Node) -> bool {
        selects(&self.node_selector, &n.labels) && n.taints.iter().all(|t| self.tolerations.iter().any(|tol| tol.tolerates(t)))
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Protocol {
    Tcp,
    Udp,
}

impl Protocol {
    /// The IP protocol number (the data path's key).
    pub fn number(self) -> u8 {
        match self {
            Protocol::Tcp => vip_common::PROTO_TCP,
            Protocol::Udp => vip_common::PROTO_UDP,
        }
    }

    pub fn from_number(n: u8) -> Option<Self> {
        match n {
            vip_common::PROTO_TCP => Some(Protocol::Tcp),
            vip_common::PROTO_UDP => Some(Protocol::Udp),
            _ => None,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Protocol::Tcp => "tcp",
            Protocol::Udp => "udp",
        }
    }
}

impl std::fmt::Display for Protocol {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// One balanced service-port: (VIP, port, protocol). A `Service` has one per port.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ServiceAddr {
    pub vip: IpAddr,
    pub port: u16,
    pub protocol: Protocol,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
pub enum Probe {
    Tcp { port: u16 },
    Http { port: u16, path: String },
}

#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
pub struct HealthCheck {
    pub probe: Probe,
    pub interval: Duration,
    pub timeout: Duration,
    /// Consecutive successes that bring a down backend back.
    pub rise: u32,
    /// Consecutive failures that take an up backend out of every ring.
    pub fall: u32,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Service {
    pub name: String,
    pub vip: IpAddr,
    pub ports: Vec<u16>,
    pub protocol: Protocol,
    /// Maglev table size (prime, 251..=131071).
    pub table_size: u32,
    /// Which nodes are its backends (before health): defaults to the pool's selector.
    pub backend_selector: Selector,
    /// When set, only these nodes are candidates (Kubernetes `externalTrafficPolicy:
    /// Local`: the nodes with ready endpoints of the Service).
    pub backend_nodes: Option<std::collections::BTreeSet<String>>,
    pub health: Option<HealthCheck>,
    /// What happens when the health check has every backend down.
    pub no_healthy_backend: NoHealthyBackend,
}

impl Service {
    /// One data-path service per port.
    pub fn addrs(&self) -> impl Iterator<Item = ServiceAddr> + '_ {
        self.ports.iter().map(|&port| ServiceAddr { vip: self.vip, port, protocol: self.protocol })
    }
}

/// What a service-port does when its health check has every backend down.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
pub enum NoHealthyBackend {
    /// Spread new connections over every backend the health check has down (nodes
    /// whose agent is dead or that left the cluster stay out), as cloud load
    /// balancers do: when every check fails at once, the cause is more likely the
    /// checks (kube-proxy restarting everywhere, its health port blocked) than
    /// every backend.
    #[default]
    FailOpen,
    /// Drop new connections (`drop_no_backend`) until a backend is healthy again.
    Drop,
}

/// How the holder of a pool's VIP makes the network send it the VIP's traffic.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum AnnounceMode {
    /// The holder answers ARP for the VIP (XDP) and sends gratuitous ARP on takeover.
    #[default]
    Arp,
    /// The VIP is only added to the holder's loopback (`lo`) for a routing daemon on
    /// the node (BGP/ECMP) to announce: no ARP answers, no gratuitous ARP. The
    /// holder still balances the VIP's traffic over the ring.
    Lo,
    /// Every live eligible node holds the VIP (whatever `distribution` says): it
    /// goes on each one's loopback, and the agent has the node's FRR announce it
    /// to the BGP peers of the config's `bgp` section, for the routers to spread
    /// its traffic by ECMP. No ARP answers, no gratuitous ARP. Not in the
    /// VipPool schema: no resource gives BGP sessions yet.
    #[schemars(skip)]
    Bgp,
}

impl AnnounceMode {
    /// Whether the holder puts the VIP on `lo` rather than answering ARP for it.
    pub fn on_lo(self) -> bool {
        matches!(self, AnnounceMode::Lo | AnnounceMode::Bgp)
    }

    /// Whether every live eligible node of `distribution` holds the VIP.
    pub fn everywhere(self, distribution: Distribution) -> bool {
        self == AnnounceMode::Bgp || distribution == Distribution::All
    }
}

/// Which of a pool's live eligible nodes hold each of its VIPs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum Distribution {
    /// One node per VIP, spread evenly over the eligible nodes (rendezvous
    /// hashing); it moves when that node dies.
    #[default]
    One,
    /// Every live eligible node (`announce: lo` only): each puts the VIP on its
    /// loopback, so that the routing daemons of all of them announce it and the
    /// routers spread its traffic by ECMP; each balances what reaches it over the
    /// same rings, so a flow the router moves to another node keeps its backend.
    All,
}

/// Gratuitous ARP of a holder: `count` frames `interval` apart on takeover, then
/// one every `refresh` while holding (switch FDB and neighbour entries age out).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
pub struct Garp {
    pub count: u32,
    pub interval: Duration,
    pub refresh: Duration,
}

impl Default for Garp {
    fn default() -> Self {
        Self { count: 3, interval: Duration::from_millis(100), refresh: Duration::from_secs(30) }
    }
}

/// How the holder of a VIP announces it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Announce {
    /// The deadline written with each held VIP: a holder that stops refreshing
    /// (hung agent) stops answering ARP this long after its last refresh.
    pub hold_time: Duration,
    /// Gratuitous ARP of pools that set none of their own.
    pub garp: Garp,
}

impl Default for Announce {
    fn default() -> Self {
        Self { hold_time: Duration::from_millis(200), garp: Garp::default() }
    }
}

/// Failure detection between agents (heartbeats on the node network).
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Failover {
    /// UDP port every agent sends heartbeats from and receives them on.
    pub heartbeat_port: u16,
    pub heartbeat_interval: Duration,
    /// A node not heard from for this long is dead and its VIPs move. At least
    /// 4/3 of `announce.hold_time`: a wedged owner has stopped answering by then.
    pub dead_after: Duration,
}

impl Default for Failover {
    fn default() -> Self {
        Self { heartbeat_port: 7473, heartbeat_interval: Duration::from_millis(50), dead_after: Duration::from_millis(300) }
    }
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct World {
    pub nodes: Vec<Node>,
    pub pools: Vec<Pool>,
    pub services: Vec<Service>,
    pub announce: Announce,
    pub failover: Failover,
    /// The BGP sessions of `announce: bgp` pools (the config file's `bgp`).
    pub bgp: Option<crate::bgp::Settings>,
    /// Seed of the Maglev permutation: equal on every node, or rings differ.
    pub maglev_seed: u64,
    /// Nodes of the cluster not in `nodes`, with why (Kubernetes: excluded from
    /// load balancers, not ready): said when a pool is left with no node to hold
    /// its VIPs.
    pub left_out: BTreeMap<String, String>,
}

/// The settings every agent of a cluster must share: the failover timers,
/// gratuitous ARP defaults and the Maglev seed (Kubernetes: each agent's flags;
/// file: the file each node reads). Agents that disagree split: a node with
/// another `deadAfter` declares peers dead at another time, another seed builds
/// other rings. Each agent sends these to its peers in its heartbeats
/// (`ha::heartbeat`), and reports those of a peer that differ
/// ([`settings_differing`]).
pub fn cluster_settings(w: &World) -> String {
    let (a, f) = (&w.announce, &w.failover);
    [
        ("holdTime", format!("{:?}", a.hold_time)),
        ("garpCount", a.garp.count.to_string()),
        ("garpInterval", format!("{:?}", a.garp.interval)),
        ("garpRefresh", format!("{:?}", a.garp.refresh)),
        ("heartbeatPort", f.heartbeat_port.to_string()),
        ("heartbeatInterval", format!("{:?}", f.heartbeat_interval)),
        ("deadAfter", format!("{:?}", f.dead_after)),
        ("maglevSeed", w.maglev_seed.to_string()),
    ]
    .map(|(k, v)| format!("{k}={v}"))
    .join(" ")
}

/// This agent's release (the workspace's version: the image's tag, the
/// changelog's heading).
pub const VERSION: &str = env!("CARGO_PKG_VERSION");

/// What the heartbeats carry: [`cluster_settings`] and this agent's [`VERSION`],
/// which peers show in their status (a mixed-version cluster during an upgrade)
/// but do not compare.
pub fn announced_settings(w: &World) -> String {
    format!("{} version={VERSION} {ANSWERS_ASKS}", cluster_settings(w))
}

/// The word of [`announced_settings`] that says the sender's data path answers
/// asks (`vip_common::ETH_P_ASK4`): only such a previous holder is asked about
/// the flows it may have pinned (0.1.0's data path drops them).
const ANSWERS_ASKS: &str = "asks=1";

/// Whether a peer's [`announced_settings`] say its data path answers asks.
pub fn answers_asks(announced: &str) -> bool {
    announced.split_whitespace().any(|w| w == ANSWERS_ASKS)
}

/// The version in a peer's [`announced_settings`]; None from an agent of before
/// (0.1.0 and earlier send none).
pub fn version_of(announced: &str) -> Option<&str> {
    announced.split_whitespace().find_map(|w| w.strip_prefix("version="))
}

/// The settings of [`cluster_settings`] texts that differ, as (name, here,
/// there): only those both name, so that an agent of another version, with more
/// or fewer settings, is compared on what both have. The version is no setting:
/// agents of two releases run side by side during an upgrade.
pub fn settings_differing(here: &str, there: &str) -> Vec<(String, String, String)> {
    let words = |t: &str| -> BTreeMap<String, String> {
        t.split_whitespace().filter_map(|w| w.split_once('=')).filter(|(k, _)| *k != "version").map(|(k, v)| (k.to_owned(), v.to_owned())).collect()
    };
    let (here, there) = (words(here), words(there));
    here.into_iter().filter_map(|(k, h)| there.get(&k).filter(|t| **t != h).map(|t| (k, h, t.clone()))).collect()
}

/// Why no node holds a VIP: what the agents tell the elected controller, which
/// groups a pool's unheld VIPs by it (its `Held=False` message, VipStatus).
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, thiserror::Error)]
pub enum NoHolder {
    /// No node of the model may hold the pool's addresses.
    #[error(
        "no node may hold VipPool {pool:?}'s addresses: none of the {nodes} node(s) in use matches its nodeSelector and tolerations{}",
        left_out_note(left_out)
    )]
    NoEligibleNode {
        pool: String,
        /// Nodes in the model.
        nodes: usize,
        /// Cluster nodes not in the model, with why (`World::left_out`).
        left_out: Vec<(String, String)>,
    },
    /// The pool's eligible nodes are all silent, as a live member hears it.
    #[error("none of VipPool {pool:?}'s eligible nodes ({}) is alive: no heartbeats heard", eligible.join(", "))]
    NoneAlive { pool: String, eligible: Vec<String> },
}

/// The first five left-out nodes, for [`NoHolder::NoEligibleNode`]'s message.
fn left_out_note(left_out: &[(String, String)]) -> String {
    if left_out.is_empty() {
        return String::new();
    }
    let some: Vec<String> = left_out.iter().take(5).map(|(n, r)| format!("{n} ({r})")).collect();
    let more = left_out.len().saturating_sub(5);
    format!("; left out: {}{}", some.join(", "), if more > 0 { format!(" and {more} more") } else { String::new() })
}

impl World {
    pub fn node(&self, name: &str) -> Option<&Node> {
        self.nodes.iter().find(|n| n.name == name)
    }

    pub fn pool_of(&self, vip: impl Into<IpAddr>) -> Option<&Pool> {
        let vip = vip.into();
        self.pools.iter().find(|p| p.addresses.binary_search(&vip).is_ok())
    }

    /// How `vip` is announced (its pool's mode; ARP outside every pool).
    pub fn announce_mode(&self, vip: impl Into<IpAddr>) -> AnnounceMode {
        self.pool_of(vip).map_or(AnnounceMode::Arp, |p| p.announce)
    }

    /// The gratuitous ARP settings of `vip`: its pool's, else the world's.
    pub fn garp(&self, vip: impl Into<IpAddr>) -> Garp {
        self.pool_of(vip).and_then(|p| p.garp).unwrap_or(self.announce.garp)
    }

    /// Nodes eligible to hold the VIPs of `pool`, in name order.
    pub fn eligible(&self, pool: &Pool) -> Vec<&Node> {
        self.nodes.iter().filter(|n| pool.admits(n)).collect()
    }

    /// Nodes eligible to hold some pool's VIPs: the ones that exchange heartbeats.
    pub fn holders(&self) -> Vec<&Node> {
        self.nodes.iter().filter(|n| self.pools.iter().any(|p| p.admits(n))).collect()
    }

    /// Candidate backends of `svc` (before health), in name order.
    pub fn backend_candidates(&self, svc: &Service) -> Vec<&Node> {
        self.nodes.iter().filter(|n| selects(&svc.backend_selector, &n.labels) && svc.backend_nodes.as_ref().is_none_or(|b| b.contains(&n.name))).collect()
    }
}

/// [`World::backend_candidates`] for many Services: a Service whose candidates
/// are listed (`Local`: the nodes with its endpoints) costs its few nodes, not a
/// pass over every node, so planning thousands of them on a large cluster grows
/// with their endpoints rather than Services × nodes.
pub struct Candidates<'a> {
    world: &'a World,
    by_name: std::collections::HashMap<&'a str, &'a Node>,
}

impl<'a> Candidates<'a> {
    pub fn new(world: &'a World) -> Self {
        Self { world, by_name: world.nodes.iter().map(|n| (n.name.as_str(), n)).collect() }
    }

    /// The candidates of `svc`, in name order.
    pub fn of(&self, svc: &Service) -> Vec<&'a Node> {
        let Some(names) = &svc.backend_nodes else { return self.world.backend_candidates(svc) };
        // A BTreeSet iterates in name order.
        names.iter().filter_map(|n| self.by_name.get(n.as_str()).copied()).filter(|n| selects(&svc.backend_selector, &n.labels)).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn indexed_candidates_are_the_scanned_ones() {
        let node = |name: &str, role: &str| Node {
            name: name.into(),
            addr: "198.18.0.1".parse().unwrap(),
            mac: None,
            labels: [("role".to_owned(), role.to_owned())].into(),
            taints: Vec::new(),
        };
        let w = World { nodes: vec![node("a", "lb"), node("b", "web"), node("c", "lb"), node("d", "lb")], ..Default::default() };
        let svc = |selector: &[(&str, &str)], nodes: Option<&[&str]>| Service {
            name: "s".into(),
            vip: "198.18.1.1".parse().unwrap(),
            ports: vec![80],
            protocol: Protocol::Tcp,
            table_size: 251,
            backend_selector: selector.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect(),
            backend_nodes: nodes.map(|n| n.iter().map(|s| s.to_string()).collect()),
            health: None,
            no_healthy_backend: NoHealthyBackend::default(),
        };
        let c = Candidates::new(&w);
        for s in [
            svc(&[], None),
            svc(&[("role", "lb")], None),
            svc(&[], Some(&["d", "b", "gone"])),
            svc(&[("role", "lb")], Some(&["d", "b", "a"])),
            svc(&[], Some(&[])),
        ] {
            let names = |v: Vec<&Node>| v.into_iter().map(|n| n.name.clone()).collect::<Vec<_>>();
            assert_eq!(names(c.of(&s)), names(w.backend_candidates(&s)), "{:?} {:?}", s.backend_selector, s.backend_nodes);
        }
    }

    #[test]
    fn cluster_settings_name_each_shared_setting_and_differences_are_found_by_name() {
        let w = World::default();
        let here = cluster_settings(&w);
        assert_eq!(
            here,
            "holdTime=200ms garpCount=3 garpInterval=100ms garpRefresh=30s heartbeatPort=7473 heartbeatInterval=50ms deadAfter=300ms maglevSeed=0"
        );
        assert!(settings_differing(&here, &here).is_empty());
        let mut other = w.clone();
        other.failover.dead_after = Duration::from_millis(1500);
        other.maglev_seed = 7;
        assert_eq!(
            settings_differing(&here, &cluster_settings(&other)),
            [("deadAfter".into(), "300ms".into(), "1.5s".into()), ("maglevSeed".into(), "0".into(), "7".into())]
        );
        // Another version's settings: compared on the names both have.
        assert_eq!(settings_differing(&here, "deadAfter=300ms newSetting=x maglevSeed=1"), [("maglevSeed".into(), "0".into(), "1".into())]);
        assert!(settings_differing(&here, "").is_empty(), "an agent that sends none");
        // The version travels with them, and is shown, not compared.
        let announced = announced_settings(&w);
        assert_eq!(version_of(&announced), Some(VERSION));
        assert!(settings_differing(&announced, &announced.replace(&format!("version={VERSION}"), "version=0.0.1")).is_empty());
        assert!(answers_asks(&announced), "{announced}");
        assert!(!answers_asks(&cluster_settings(&w)) && !answers_asks(""), "0.1.0 sends no asks=1");
        assert_eq!(version_of(&here), None, "an agent of before sends no version");
    }
}
