//! Routed networks in the lab: an upstream router in a namespace of its own on
//! the lab's segment (FRR's zebra and bgpd, with `fib_multipath_hash_policy=1`
//! so that ECMP spreads flows by port), a client behind it on a network of
//! their own, and a BGP speaker on each node: BIRD exporting the VIPs on `lo`,
//! as Calico's BIRD exports a node's external IPs in the seed's ECMP set-up.
//!
//! Everything lives in namespaces the lab made, on 198.18.0.0/15; the daemons
//! are children of the test, killed on Drop.
use std::{
    collections::{BTreeMap, BTreeSet},
    net::{IpAddr, Ipv4Addr, Ipv6Addr},
    path::{Path, PathBuf},
    process::{Child, Stdio},
    time::Duration,
};

use anyhow::{bail, Context, Result};

use crate::{
    agent::wait_for,
    halab::{node_addr6, vip, vip6, vip_nets, BgpSpec, HaLab, HaNode, HaSpec, LongConn, Naming, VIP6_NET},
    netns::{veth, NetNs},
};

/// The router's address on the lab's segment: the nodes' BGP peer.
pub const ROUTER: Ipv4Addr = Ipv4Addr::new(198, 18, 0, 1);
/// The network between the router and the far client.
pub const FAR_NET: &str = "198.19.200.0/24";
const FAR_ROUTER: Ipv4Addr = Ipv4Addr::new(198, 19, 200, 1);
/// The client behind the router: its traffic to a VIP crosses the router's ECMP.
pub const FAR_CLIENT: Ipv4Addr = Ipv4Addr::new(198, 19, 200, 2);
/// The router's IPv6 address on the segment (a dual-stack lab's), the far
/// network's, the router's and the client's there.
pub const ROUTER6: Ipv6Addr = Ipv6Addr::new(0x2001, 2, 0, 0, 0, 0, 0, 1);
pub const FAR_NET6: &str = "2001:2:0:200::/64";
const FAR_ROUTER6: Ipv6Addr = Ipv6Addr::new(0x2001, 2, 0, 0x200, 0, 0, 0, 1);
pub const FAR_CLIENT6: Ipv6Addr = Ipv6Addr::new(0x2001, 2, 0, 0x200, 0, 0, 0, 2);
pub const ROUTER_AS: u32 = 64512;
/// Every node's AS (one AS for all nodes: the router's multipath needs equal AS paths).
pub const NODE_AS: u32 = 64513;
/// BGP keepalive and hold times (s) on both sides: short, so that a dead node's
/// routes go within a few seconds without BFD.
pub const KEEPALIVE_S: u32 = 1;
pub const HOLD_S: u32 = 3;
/// BFD on the sessions ([`RoutedLab::start`]'s `bfd`): FRR's defaults, 300 ms
/// intervals, 3 missed.
pub const BFD_INTERVAL_MS: u32 = 300;
pub const BFD_MULTIPLIER: u32 = 3;
/// The community an `announce: bgp` lab's pool puts on its routes.
pub const COMMUNITY: &str = "64513:100";

const FRR: &str = "/usr/lib/frr";

/// The upstream router (FRR) and the client behind it.
pub struct Router {
    // Drop order: the daemons first, then the namespaces.
    pub frr: Frr,
    pub client: NetNs,
    pub ns: NetNs,
    pub mac: [u8; 6],
    /// The sessions are checked by BFD.
    pub bfd: bool,
}

impl Router {
    /// Plugs a router into `lab`'s segment, a client behind it, and starts FRR's
    /// zebra and bgpd there, accepting BGP sessions from every address of the
    /// segment (AS [`NODE_AS`]) and installing up to 16 equal paths. The nodes
    /// get a route to [`FAR_NET`] through it (their answers go straight back to
    /// the client: direct server return).
    pub fn start(lab: &HaLab, bfd: bool) -> Result<Self> {
        let ns = lab.seg.plug(NetNs::new("vrt")?, &format!("{ROUTER}/24"))?;
        let client = NetNs::new("vrc")?;
        veth(&ns, "eth1", &client, "eth0")?;
        ns.ip(&["addr", "add", &format!("{FAR_ROUTER}/24"), "dev", "eth1"])?;
        client.ip(&["addr", "add", &format!("{FAR_CLIENT}/24"), "dev", "eth0"])?;
        client.ip(&["route", "add", "default", "via", &FAR_ROUTER.to_string()])?;
        ns.sysctl("net.ipv4.ip_forward", "1")?;
        // Layer 4 hashing: flows of one client spread over the next hops by port.
        ns.sysctl("net.ipv4.fib_multipath_hash_policy", "1")?;
        for n in &lab.nodes {
            n.ns.ip(&["route", "add", FAR_NET, "via", &ROUTER.to_string()])?;
        }
        if lab.spec.ipv6 {
            ns.ip(&["-6", "addr", "add", &format!("{ROUTER6}/64"), "dev", "eth0", "nodad"])?;
            ns.ip(&["-6", "addr", "add", &format!("{FAR_ROUTER6}/64"), "dev", "eth1", "nodad"])?;
            client.ip(&["-6", "addr", "add", &format!("{FAR_CLIENT6}/64"), "dev", "eth0", "nodad"])?;
            client.ip(&["-6", "route", "add", "default", "via", &FAR_ROUTER6.to_string()])?;
            ns.sysctl("net.ipv6.conf.all.forwarding", "1")?;
            ns.sysctl("net.ipv6.fib_multipath_hash_policy", "1")?;
            for n in &lab.nodes {
                n.ns.ip(&["-6", "route", "add", FAR_NET6, "via", &ROUTER6.to_string()])?;
            }
            // bgpd takes IPv6 sessions only once eth0 has a link-local address
            // past duplicate address detection (its next hop for them).
            let ready = wait_for(Duration::from_secs(10), || {
                let o = ns.ip(&["-6", "addr", "show", "dev", "eth0", "scope", "link"]).ok()?;
                let text = String::from_utf8_lossy(&o.stdout).into_owned();
                (text.contains("inet6 fe80") && !text.contains("tentative")).then_some(())
            });
            anyhow::ensure!(ready.is_some(), "the router's eth0 has no usable IPv6 link-local address after 10 s");
        }
        let dir = lab.dir.join("router");
        std::fs::create_dir_all(&dir)?;
        let mac = ns.mac("eth0")?;
        let frr = Self::start_frr(&ns, &dir, bfd, lab.spec.ipv6)?;
        Ok(Self { frr, client, ns, mac, bfd })
    }

    /// zebra and bgpd (and bfdd with `bfd`, the sessions then checked by BFD).
    fn start_frr(ns: &NetNs, d: &Path, bfd: bool, ipv6: bool) -> Result<Frr> {
        std::fs::write(d.join("zebra.conf"), "hostname router\n")?;
        std::fs::write(
            d.join("bfdd.conf"),
            format!(
                "hostname router\nbfd\n profile nodes\n  receive-interval {BFD_INTERVAL_MS}\n  transmit-interval {BFD_INTERVAL_MS}\n  detect-multiplier {BFD_MULTIPLIER}\n"
            ),
        )?;
        let bfd_neighbor = if bfd { " neighbor nodes bfd profile nodes\n" } else { "" };
        // IPv6: sessions of their own over the segment's IPv6 addresses.
        let (peers6, family6) = if ipv6 {
            (
                format!(
                    " neighbor nodes6 peer-group\n neighbor nodes6 remote-as {NODE_AS}\n neighbor nodes6 timers {KEEPALIVE_S} {HOLD_S}\n \
                     neighbor nodes6 advertisement-interval 0\n{bfd6} bgp listen range 2001:2::/64 peer-group nodes6\n",
                    bfd6 = if bfd { " neighbor nodes6 bfd profile nodes\n" } else { "" }
                ),
                " address-family ipv6 unicast\n  neighbor nodes6 activate\n  maximum-paths 16\n exit-address-family\n",
            )
        } else {
            (String::new(), "")
        };
        std::fs::write(
            d.join("bgpd.conf"),
            format!(
                "hostname router\n\
                 router bgp {ROUTER_AS}\n \
                 bgp router-id {ROUTER}\n \
                 no bgp ebgp-requires-policy\n \
                 no bgp default ipv4-unicast\n \
                 timers bgp {KEEPALIVE_S} {HOLD_S}\n \
                 neighbor nodes peer-group\n \
                 neighbor nodes remote-as {NODE_AS}\n \
                 neighbor nodes timers {KEEPALIVE_S} {HOLD_S}\n \
                 neighbor nodes advertisement-interval 0\n\
                 {bfd_neighbor} \
                 bgp listen range 198.18.0.0/24 peer-group nodes\n\
                 {peers6} \
                 address-family ipv4 unicast\n  \
                 neighbor nodes activate\n  \
                 maximum-paths 16\n \
                 exit-address-family\n\
                 {family6}"
            ),
        )?;
        Frr::start(ns, d, Frr::daemons(bfd))
    }

    /// Runs `vtysh -c cmd` against the router's daemons.
    pub fn vtysh(&self, cmd: &str) -> Result<String> {
        self.frr.vtysh(&self.ns, cmd)
    }

    /// The next hops bgpd selected and zebra installed for `vip` (a host route),
    /// from the router's RIB (`show ip[v6] route VIP/32|128 json`: active and in
    /// the FIB).
    pub fn rib_next_hops(&self, vip: IpAddr) -> Result<BTreeSet<IpAddr>> {
        let (family, len) = if vip.is_ipv4() { ("ip", 32) } else { ("ipv6", 128) };
        let prefix = format!("{vip}/{len}");
        let text = self.vtysh(&format!("show {family} route {prefix} json"))?;
        let v: serde_json::Value = serde_json::from_str(&text).with_context(|| format!("vtysh's route JSON: {text}"))?;
        let mut hops = BTreeSet::new();
        for route in v[&prefix].as_array().into_iter().flatten().filter(|r| r["protocol"] == "bgp" && r["selected"] == true) {
            for nh in route["nexthops"].as_array().into_iter().flatten().filter(|n| n["active"] == true && n["fib"] == true) {
                hops.insert(nh["ip"].as_str().context("next hop without ip")?.parse()?);
            }
        }
        Ok(hops)
    }

    /// The next hops of the kernel's route to `vip` in the router's namespace
    /// (`ip -j route show VIP`): what forwarding uses.
    pub fn fib_next_hops(&self, vip: IpAddr) -> Result<BTreeSet<IpAddr>> {
        let family = if vip.is_ipv4() { "-4" } else { "-6" };
        let o = self.ns.ip(&["-j", family, "route", "show", &vip.to_string()])?;
        let v: serde_json::Value = serde_json::from_slice(&o.stdout)?;
        let mut hops = BTreeSet::new();
        for route in v.as_array().into_iter().flatten() {
            let one = route.get("gateway").map(|g| vec![g]);
            let many = route["nexthops"].as_array().map(|n| n.iter().map(|h| &h["gateway"]).collect());
            for g in one.or(many).unwrap_or_default() {
                hops.insert(g.as_str().context("next hop without gateway")?.parse()?);
            }
        }
        Ok(hops)
    }

    /// The router's BGP sessions: state and how many times each was established.
    pub fn sessions(&self) -> Result<BTreeMap<IpAddr, (String, u64)>> {
        let text = self.vtysh("show bgp neighbors json")?;
        let v: serde_json::Value = serde_json::from_str(&text).with_context(|| format!("vtysh's neighbors JSON: {text}"))?;
        let mut out = BTreeMap::new();
        for (k, n) in v.as_object().into_iter().flatten() {
            let Ok(addr) = k.parse::<IpAddr>() else { continue };
            let state = n["bgpState"].as_str().unwrap_or_default().to_owned();
            out.insert(addr, (state, n["connectionsEstablished"].as_u64().unwrap_or(0)));
        }
        Ok(out)
    }

    /// Waits until `peers` sessions are Established; their count of establishments.
    pub fn wait_sessions(&self, peers: usize) -> Result<BTreeMap<IpAddr, u64>> {
        let up = || -> Option<BTreeMap<IpAddr, u64>> {
            let s = self.sessions().ok()?;
            let up: BTreeMap<IpAddr, u64> = s.into_iter().filter(|(_, (st, _))| st == "Established").map(|(a, (_, n))| (a, n)).collect();
            (up.len() == peers).then_some(up)
        };
        wait_for(ROUTE_WAIT, up).with_context(|| format!("not {peers} BGP sessions established: {}", self.vtysh("show bgp summary").unwrap_or_default()))
    }

    /// The communities on the paths to `vip` the router has.
    pub fn communities(&self, vip: IpAddr) -> Result<BTreeSet<String>> {
        let (family, len) = if vip.is_ipv4() { ("ipv4", 32) } else { ("ipv6", 128) };
        let text = self.vtysh(&format!("show bgp {family} unicast {vip}/{len} json"))?;
        let v: serde_json::Value = serde_json::from_str(&text).with_context(|| format!("vtysh's route JSON: {text}"))?;
        let paths = v["paths"].as_array().with_context(|| format!("no paths for {vip}: {text}"))?;
        Ok(paths.iter().filter_map(|p| p["community"]["string"].as_str()).map(str::to_owned).collect())
    }

    /// Waits until `peers` BFD sessions are up (they come up a few seconds after
    /// their BGP sessions).
    pub fn wait_bfd_up(&self, peers: usize) -> Result<()> {
        let up = || -> Option<usize> {
            let v: serde_json::Value = serde_json::from_str(&self.vtysh("show bfd peers json").ok()?).ok()?;
            Some(v.as_array()?.iter().filter(|p| p["status"] == "up").count())
        };
        if wait_for(ROUTE_WAIT, || (up()? == peers).then_some(())).is_none() {
            bail!("{:?} of {peers} BFD sessions up after {ROUTE_WAIT:?}: {}", up(), self.vtysh("show bfd peers brief").unwrap_or_default());
        }
        Ok(())
    }

    /// Waits until both the RIB and the FIB have `vip`'s next hops as `want`
    /// says (each set is given to it); how long that took.
    pub fn wait_next_hops(&self, vip: IpAddr, want: impl Fn(&BTreeSet<IpAddr>) -> bool, limit: Duration) -> Result<Duration> {
        let t = std::time::Instant::now();
        let reached = wait_for(limit, || (want(&self.rib_next_hops(vip).ok()?) && want(&self.fib_next_hops(vip).ok()?)).then_some(()));
        if reached.is_none() {
            bail!(
                "the router's next hops for {vip}: RIB {:?}, FIB {:?}, not as wanted after {limit:?}; bgp: {}",
                self.rib_next_hops(vip).ok(),
                self.fib_next_hops(vip).ok(),
                self.vtysh("show bgp summary").unwrap_or_default()
            );
        }
        Ok(t.elapsed())
    }
}

/// FRR's daemons in a namespace, each reading `DIR/DAEMON.conf` (empty if the
/// caller wrote none) and with its sockets and logs in `DIR`: the router's, and
/// a node's with [`HaSpec::bgp`] (its agent gives them their configuration
/// through `frr-reload.py`); killed on Drop.
pub struct Frr {
    daemons: Vec<Child>,
    pub dir: PathBuf,
}

impl Frr {
    /// The daemons BGP needs: zebra and bgpd, and bfdd for BFD (started in
    /// this order: bgpd and bfdd talk to zebra).
    pub fn daemons(bfd: bool) -> &'static [&'static str] {
        if bfd {
            &["zebra", "bfdd", "bgpd"]
        } else {
            &["zebra", "bgpd"]
        }
    }

    pub fn start(ns: &NetNs, dir: &Path, daemons: &[&str]) -> Result<Self> {
        std::fs::create_dir_all(dir)?;
        for daemon in daemons {
            let conf = dir.join(format!("{daemon}.conf"));
            if !conf.exists() {
                std::fs::write(&conf, "")?;
            }
        }
        // The daemons drop to user frr (zebra has no way to stay root): the
        // directory is theirs.
        crate::netns::sh(&["chown", "-R", "frr:frr", path(dir)?]).context("chown to FRR's user (is the frr package installed? `cargo xtask setup --tests`)")?;
        let mut frr = Self { daemons: Vec::new(), dir: dir.to_owned() };
        let zsock = dir.join("zserv.api");
        for &daemon in daemons {
            let file = |ext: &str| dir.join(format!("{daemon}.{ext}")).display().to_string();
            // A socket left by daemons killed before (a restart in the same directory).
            let _ = std::fs::remove_file(dir.join(format!("{daemon}.vty")));
            // Sockets and the vty in the lab's directory (no /run/frr of the
            // host), no TCP vty; the daemons run as the package's user `frr`.
            let args = [
                "-f".into(),
                file("conf"),
                "-i".into(),
                file("pid"),
                "--log".into(),
                format!("file:{}", file("log")),
                "-z".into(),
                path(&zsock)?.into(),
                "--vty_socket".into(),
                path(dir)?.into(),
                "-P".into(),
                "0".into(),
            ];
            let child = ns
                .cmd(&format!("{FRR}/{daemon}"))
                .args(&args)
                .stdout(Stdio::null())
                .stderr(std::fs::File::create(dir.join(format!("{daemon}.stderr")))?)
                .spawn()
                .with_context(|| format!("starting FRR's {daemon} (is the frr package installed? `cargo xtask setup --tests`)"))?;
            frr.daemons.push(child);
            // bgpd talks to zebra through its socket, and vtysh to each daemon's.
            let vty = dir.join(format!("{daemon}.vty"));
            if wait_for(Duration::from_secs(10), || vty.exists().then_some(())).is_none() {
                bail!("FRR's {daemon} did not open {} within 10 s: {}", vty.display(), frr.log_tail(daemon));
            }
        }
        Ok(frr)
    }

    /// The tail of a daemon's log and stderr, for an error.
    pub fn log_tail(&self, daemon: &str) -> String {
        [format!("{daemon}.log"), format!("{daemon}.stderr")]
            .iter()
            .map(|f| {
                let t = std::fs::read_to_string(self.dir.join(f)).unwrap_or_default();
                let lines: Vec<&str> = t.lines().collect();
                format!("{f}: {}", lines[lines.len().saturating_sub(8)..].join(" | "))
            })
            .collect::<Vec<_>>()
            .join("; ")
    }

    /// Runs `vtysh -c cmd` against these daemons (in `ns`, where they run).
    pub fn vtysh(&self, ns: &NetNs, cmd: &str) -> Result<String> {
        let o = ns.cmd("vtysh").args(["--vty_socket", path(&self.dir)?, "-c", cmd]).output()?;
        anyhow::ensure!(o.status.success(), "vtysh -c {cmd:?}: {}", String::from_utf8_lossy(&o.stderr));
        Ok(String::from_utf8(o.stdout)?)
    }
}

impl Drop for Frr {
    fn drop(&mut self) {
        for c in &mut self.daemons {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// A node's BGP speaker.
pub enum Speaker {
    /// The user's own (`announce: lo`, `distribution: all`).
    Bird(Bird),
    /// The one its agent drives ([`HaSpec::bgp`]).
    Frr(Frr),
}

/// BIRD on a node, peering with the [`ROUTER`] and exporting the VIPs on its
/// `lo` (host routes in `vip_nets`, the way the seed's Calico filter exports
/// `lo`'s external IPs); killed on Drop.
pub struct Bird {
    child: Child,
}

impl Bird {
    /// With `bfd`, the session is checked by BFD ([`BFD_INTERVAL_MS`], [`BFD_MULTIPLIER`]).
    /// With `addr6` (a dual-stack lab), a second session over IPv6 from that
    /// address exports the IPv6 VIPs on `lo` ([`VIP6_NET`]).
    pub fn start(node: &HaNode, dir: &Path, vip_nets: &[String], bfd: bool, addr6: Option<Ipv6Addr>) -> Result<Self> {
        let dir = dir.join(format!("bird-{}", node.name));
        std::fs::create_dir_all(&dir)?;
        let conf = dir.join("bird.conf");
        let nets: Vec<String> = vip_nets.iter().map(|n| format!("{n}{{32,32}}")).collect();
        let (bfd_proto, bfd_on) = if bfd {
            (
                format!(
                    "protocol bfd {{ interface \"eth0\" {{ min rx interval {BFD_INTERVAL_MS} ms; min tx interval {BFD_INTERVAL_MS} ms; multiplier {BFD_MULTIPLIER}; }}; }}\n"
                ),
                "  bfd on;\n",
            )
        } else {
            (String::new(), "")
        };
        let (direct6, upstream6) = match addr6 {
            Some(a6) => (
                " ipv6;",
                format!(
                    "protocol bgp upstream6 {{\n{bfd_on}  local {a6} as {NODE_AS};\n  neighbor {ROUTER6} as {ROUTER_AS};\n  \
                     hold time {HOLD_S};\n  keepalive time {KEEPALIVE_S};\n  connect delay time 1;\n  connect retry time 1;\n  \
                     ipv6 {{ import none; export where source = RTS_DEVICE && net ~ [ {VIP6_NET}{{128,128}} ]; }};\n}}\n"
                ),
            ),
            None => ("", String::new()),
        };
        std::fs::write(
            &conf,
            format!(
                "router id {addr};\n\
                 protocol device {{ scan time 1; }}\n\
                 protocol direct lo_vips {{ ipv4;{direct6} interface \"lo\"; }}\n\
                 {bfd_proto}\
                 protocol bgp upstream {{\n{bfd_on}  \
                   local {addr} as {NODE_AS};\n  \
                   neighbor {ROUTER} as {ROUTER_AS};\n  \
                   hold time {HOLD_S};\n  keepalive time {KEEPALIVE_S};\n  \
                   connect delay time 1;\n  connect retry time 1;\n  \
                   ipv4 {{ import none; export where source = RTS_DEVICE && net ~ [ {} ]; }};\n\
                 }}\n\
                 {upstream6}",
                nets.join(", "),
                addr = node.addr,
            ),
        )?;
        let ctl = dir.join("bird.ctl");
        let child = node
            .ns
            .cmd("bird")
            .args(["-f", "-c", path(&conf)?, "-s", path(&ctl)?, "-P", path(&dir.join("bird.pid"))?])
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(dir.join("bird.stderr"))?)
            .spawn()
            .context("starting BIRD (is the bird2 package installed? `cargo xtask setup --tests`)")?;
        Ok(Self { child })
    }
}

impl Drop for Bird {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Counters in the segment's bridge of the frames the router sends each node
/// for `dst` (an nftables prefix): which nodes the router's ECMP picks.
pub struct Ingress<'a> {
    lab: &'a HaLab,
    table: String,
}

impl<'a> Ingress<'a> {
    pub fn count(lab: &'a HaLab, router: &Router, dst: &str) -> Result<Self> {
        let table = crate::netns::unique("vipecmp").replace('-', "_");
        let seg = &lab.seg.ns;
        seg.nft(&["add", "table", "bridge", &table])?;
        seg.nft(&["add", "chain", "bridge", &table, "toward", "{ type filter hook forward priority 0 ; }"])?;
        let from = crate::netns::hex_mac(router.mac);
        for n in &lab.nodes {
            let to = crate::netns::hex_mac(n.mac);
            seg.nft(&["add", "rule", "bridge", &table, "toward", "ether", "saddr", &from, "ether", "daddr", &to, "ip", "daddr", dst, "counter"])?;
        }
        Ok(Self { lab, table })
    }

    /// Frames counted per node name since [`Self::count`].
    pub fn per_node(&self) -> Result<BTreeMap<String, u64>> {
        let text = self.lab.seg.ns.nft(&["list", "chain", "bridge", &self.table, "toward"])?;
        let mut out = BTreeMap::new();
        for n in &self.lab.nodes {
            let mac = crate::netns::hex_mac(n.mac).to_lowercase();
            let line = text.lines().find(|l| l.contains(&mac)).with_context(|| format!("no counter for {} in {text}", n.name))?;
            out.insert(n.name.clone(), crate::netns::nft_packets(line).with_context(|| format!("no packet count in {line}"))?);
        }
        Ok(out)
    }
}

/// Bound on the router learning a change (BIRD and FRR send and apply updates
/// at once; the hold timer is not involved).
pub const ROUTE_WAIT: Duration = Duration::from_secs(15);

/// A lab of HA nodes: the file-mode lab, or the Kubernetes one around it.
pub trait Lab {
    fn ha(&self) -> &HaLab;
    fn ha_mut(&mut self) -> &mut HaLab;
}

impl Lab for HaLab {
    fn ha(&self) -> &HaLab {
        self
    }
    fn ha_mut(&mut self) -> &mut HaLab {
        self
    }
}

impl Lab for crate::kubelab::KubeLab {
    fn ha(&self) -> &HaLab {
        &self.lab
    }
    fn ha_mut(&mut self) -> &mut HaLab {
        &mut self.lab
    }
}

/// The HA lab (file mode, or Kubernetes mode around it) with a [`Router`] and a
/// [`Speaker`] on every node, its VIPs accepted by local routes
/// ([`HaSpec::lo_everywhere`]).
pub struct RoutedLab<L: Lab = HaLab> {
    // Drop order: speakers and router before the lab's namespaces.
    pub speakers: Vec<Speaker>,
    pub router: Router,
    pub lab: L,
}

/// Connections broken when a node leaves the ECMP set and when it rejoins,
/// each as (whose backend is that node, whose backend is another), and how
/// long the router took to drop it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Churn {
    pub leave: (usize, usize),
    pub join: (usize, usize),
    pub withdrawn: Duration,
}

impl RoutedLab {
    /// File mode: `vips` VIPs on three nodes, the pool `announce: lo,
    /// distribution: all`; the agents started when `agents`; the BGP sessions
    /// checked by BFD when `bfd`.
    pub fn start(vips: usize, agents: bool, bfd: bool, server_exe: &Path) -> Result<Self> {
        Self::start_spec(HaSpec { vips, ..Default::default() }, agents, bfd, server_exe)
    }

    /// [`Self::start`] with the lab's shape from `spec` (dual-stack with `ipv6`).
    /// The speakers start before the agents: an agent's FRR must be there to
    /// be given its configuration.
    pub fn start_spec(spec: HaSpec, agents: bool, bfd: bool, server_exe: &Path) -> Result<Self> {
        let spec = HaSpec { lo_everywhere: true, ..spec };
        let mut r = Self::around(HaLab::build(spec, Naming::Unique, server_exe)?, bfd)?;
        if agents {
            for i in 0..r.lab.nodes.len() {
                r.lab.start_agent(i)?;
            }
        }
        Ok(r)
    }

    /// [`Self::start_spec`] with the pool `announce: bgp`: every node's FRR
    /// peers with the router (over IPv6 too in a dual-stack lab), driven by its
    /// agent; BFD on the sessions with `bfd`.
    pub fn start_bgp(spec: HaSpec, agents: bool, bfd: bool, server_exe: &Path) -> Result<Self> {
        let mut peers = vec![(IpAddr::from(ROUTER), ROUTER_AS)];
        if spec.ipv6 {
            peers.push((ROUTER6.into(), ROUTER_AS));
        }
        let bgp = BgpSpec { my_asn: NODE_AS, peers, keepalive_s: KEEPALIVE_S, hold_s: HOLD_S, bfd, communities: vec![COMMUNITY.into()] };
        Self::start_spec(HaSpec { bgp: Some(bgp), ..spec }, agents, bfd, server_exe)
    }
}

impl<L: Lab> RoutedLab<L> {
    /// A router and speakers around `lab` (built with [`HaSpec::lo_everywhere`]).
    pub fn around(lab: L, bfd: bool) -> Result<Self> {
        let ha = lab.ha();
        let router = Router::start(ha, bfd)?;
        let nets = vip_nets(ha.spec.vips);
        let speakers = ha
            .nodes
            .iter()
            .enumerate()
            .map(|(i, n)| match &ha.spec.bgp {
                Some(b) => Frr::start(&n.ns, &ha.frr_dir(i), Frr::daemons(b.bfd)).map(Speaker::Frr),
                None => Bird::start(n, &ha.dir, &nets, bfd, ha.spec.ipv6.then(|| node_addr6(i))).map(Speaker::Bird),
            })
            .collect::<Result<_>>()?;
        Ok(Self { speakers, router, lab })
    }

    /// Node `i`'s addresses a router may name as its next hop: its IPv4 one,
    /// and in a dual-stack lab its IPv6 and link-local ones.
    fn hop_addrs(&self, i: usize) -> Result<BTreeSet<IpAddr>> {
        let ha = self.lab.ha();
        let mut out = BTreeSet::from([ha.nodes[i].addr]);
        if ha.spec.ipv6 {
            out.insert(node_addr6(i).into());
            let o = ha.nodes[i].ns.ip(&["-j", "-6", "addr", "show", "dev", "eth0", "scope", "link"])?;
            let v: serde_json::Value = serde_json::from_slice(&o.stdout)?;
            // iproute2 lists an interface without addresses of the scope as `{}`.
            for a in v.as_array().into_iter().flatten().flat_map(|l| l["addr_info"].as_array().cloned().unwrap_or_default()) {
                if let Some(local) = a["local"].as_str() {
                    out.insert(local.parse()?);
                }
            }
        }
        Ok(out)
    }

    /// Waits for the router to have exactly `nodes` as next hops of the first
    /// `vips` VIPs (and their IPv6 twins in a dual-stack lab); the longest wait.
    pub fn wait_hops(&self, vips: usize, nodes: &[usize]) -> Result<Duration> {
        let ha = self.lab.ha();
        let addrs: Vec<BTreeSet<IpAddr>> = (0..ha.nodes.len()).map(|i| self.hop_addrs(i)).collect::<Result<_>>()?;
        let want: BTreeSet<usize> = nodes.iter().copied().collect();
        // Every hop is one of the nodes, and together they are `nodes`.
        let exactly = |hops: &BTreeSet<IpAddr>| {
            let of: Option<BTreeSet<usize>> = hops.iter().map(|h| addrs.iter().position(|a| a.contains(h))).collect();
            of.is_some_and(|of| of == want && hops.len() == want.len())
        };
        let mut all: Vec<IpAddr> = (0..vips).map(|k| vip(k).into()).collect();
        if ha.spec.ipv6 {
            all.extend((0..vips).map(|k| IpAddr::from(vip6(k))));
        }
        let mut longest = Duration::ZERO;
        for v in all {
            longest = longest.max(self.router.wait_next_hops(v, exactly, ROUTE_WAIT)?);
        }
        Ok(longest)
    }

    /// `n` connections from the far client to `v`, from ports `first..`.
    pub fn open(&self, v: impl Into<IpAddr>, first: u16, n: u16) -> Result<Vec<LongConn>> {
        let v = v.into();
        (0..n).map(|i| LongConn::open_from(&self.router.client, far_client(v), v, first + i, Duration::from_secs(3))).collect()
    }

    /// The VIPs on node `i`'s `lo` with the agent's label.
    pub fn on_lo(&self, i: usize) -> Result<BTreeSet<Ipv4Addr>> {
        let o = self.lab.ha().nodes[i].ns.ip(&["-j", "-4", "addr", "show", "dev", "lo"])?;
        let v: serde_json::Value = serde_json::from_slice(&o.stdout)?;
        let mut out = BTreeSet::new();
        for a in v.as_array().into_iter().flatten().flat_map(|l| l["addr_info"].as_array().cloned().unwrap_or_default()) {
            if a["label"] == vip_agent::ha::loopback::LABEL {
                out.insert(a["local"].as_str().context("address without local")?.parse()?);
            }
        }
        Ok(out)
    }

    /// Puts VIP 0 on node `i`'s `lo` by hand (or takes it off), as the agent
    /// labels it: plain ECMP, without agents.
    pub fn vip_on_lo(&self, i: usize, on: bool) -> Result<()> {
        let a = format!("{}/32", vip(0));
        self.lab.ha().nodes[i].ns.ip(&["addr", if on { "add" } else { "del" }, &a, "dev", "lo", "label", vip_agent::ha::loopback::LABEL])?;
        Ok(())
    }

    /// Node-3 leaves the ECMP set of VIP 0 (`set(self, false)`) and rejoins it
    /// (`set(self, true)`), with `n` connections opened before it leaves and `n`
    /// more while it is out (those that stayed on their node when it left stay
    /// there when it rejoins too, which is checked).
    pub fn leave_and_rejoin(&mut self, first_port: u16, n: u16, set: &mut dyn FnMut(&mut Self, bool) -> Result<()>) -> Result<Churn> {
        let v = vip(0);
        self.wait_hops(1, &[0, 1, 2])?;
        let mut before = self.open(v, first_port, n)?;
        let served: BTreeSet<&str> = before.iter().map(|c| c.backend.as_str()).collect();
        anyhow::ensure!(served.len() == 3, "flows reach every backend: {served:?}");
        set(self, false)?;
        let withdrawn = self.wait_hops(1, &[0, 1])?;
        let leave = broken(&mut before, "node-3");
        let mut during = self.open(v, first_port + n, n)?;
        set(self, true)?;
        self.wait_hops(1, &[0, 1, 2])?;
        let join = broken(&mut during, "node-3");
        let after_join = broken(&mut before, "node-3");
        anyhow::ensure!(after_join == (0, 0), "{after_join:?} connections that stayed on their node when node-3 left broke when it rejoined");
        Ok(Churn { leave, join, withdrawn })
    }

    /// [`Self::leave_and_rejoin`] with plain ECMP: VIP 0 on every node's `lo` by
    /// hand, each node serving what reaches it (kube-proxy without vip's rings);
    /// node-3 withdraws it and announces it again. Taken down afterwards.
    pub fn plain_churn(&mut self, first_port: u16, n: u16) -> Result<Churn> {
        for i in 0..3 {
            self.vip_on_lo(i, true)?;
        }
        let c = self.leave_and_rejoin(first_port, n, &mut |r, up| r.vip_on_lo(2, up))?;
        for i in 0..3 {
            self.vip_on_lo(i, false)?;
        }
        self.wait_hops(1, &[])?;
        Ok(c)
    }

    /// [`Self::leave_and_rejoin`] with the agents (started here if they are
    /// not running): node-3's agent stops with SIGTERM (it withdraws the VIP and
    /// stays a backend, as in a rolling update), then starts again.
    pub fn agent_churn(&mut self, first_port: u16, n: u16) -> Result<Churn> {
        for i in 0..3 {
            if self.lab.ha().nodes[i].agent.is_none() {
                self.lab.ha_mut().start_agent(i)?;
            }
        }
        self.lab.ha().wait_converged(&[0, 1, 2], Duration::from_secs(10))?;
        self.lab.ha().wait_rings_full(&[0, 1, 2], Duration::from_secs(10))?;
        self.leave_and_rejoin(first_port, n, &mut |r, up| {
            if up {
                r.lab.ha_mut().start_agent(2)
            } else {
                r.lab.ha_mut().stop_agent(2, libc::SIGTERM);
                Ok(())
            }
        })
    }
}

/// What a node's death did: how soon the router dropped it, the new connections
/// started meanwhile and after, and the long-lived ones broken.
#[derive(Clone, Debug)]
pub struct Death {
    /// From the cable pulled to the router's RIB and FIB without the node.
    pub withdrawn: Duration,
    pub attempts: usize,
    pub failed: usize,
    /// When the last new connection that failed had started, after the cable was pulled.
    pub last_failed: Option<Duration>,
    /// New connections that failed among those started after the router dropped the node.
    pub failed_after: usize,
    /// Long-lived connections broken, as (whose backend was the dead node, others').
    pub long_broken: (usize, usize),
    pub long: usize,
}

impl<L: Lab> RoutedLab<L> {
    /// Node-3 dies ([`HaLab::power_off`]: cable pulled, agent and servers gone,
    /// and its speaker with them) under a new connection to VIP 0 every 20 ms from
    /// the far client (1 s timeout each, until 1 s after the router dropped it),
    /// with `n` long-lived connections open. Its session ends by the hold timer,
    /// or by BFD where the lab has it.
    pub fn node_death(&mut self, first_port: u16, n: u16) -> Result<Death> {
        let v = vip(0);
        self.wait_hops(1, &[0, 1, 2])?;
        if self.router.bfd {
            self.router.wait_bfd_up(3)?;
        }
        let mut conns = self.open(v, first_port, n)?;
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let go = stop.clone();
        let probes = crate::load::connect_loop(&self.router.client, vec![v.into()], Duration::from_millis(20), Duration::from_secs(1), move || {
            !go.load(std::sync::atomic::Ordering::Relaxed)
        })?;
        std::thread::sleep(Duration::from_millis(300));
        let cut = std::time::Instant::now();
        self.lab.ha_mut().power_off(2)?;
        drop(self.speakers.pop());
        self.wait_hops(1, &[0, 1])?;
        let withdrawn = cut.elapsed();
        std::thread::sleep(Duration::from_secs(1));
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        let attempts = probes.join().map_err(|_| anyhow::anyhow!("the connection loop panicked"))?;
        let failed: Vec<std::time::Instant> = attempts.iter().filter(|(_, ok)| ok.is_none()).map(|(t, _)| *t).collect();
        let dropped_at = cut + withdrawn;
        Ok(Death {
            withdrawn,
            attempts: attempts.len(),
            failed: failed.len(),
            last_failed: failed.iter().max().map(|t| t.saturating_duration_since(cut)),
            failed_after: failed.iter().filter(|t| **t > dropped_at).count(),
            long_broken: broken(&mut conns, "node-3"),
            long: usize::from(n),
        })
    }
}

/// The far client's address of `vip`'s family.
pub fn far_client(vip: IpAddr) -> IpAddr {
    if vip.is_ipv4() {
        FAR_CLIENT.into()
    } else {
        FAR_CLIENT6.into()
    }
}

/// Pings every connection; removes and counts those that broke, as (whose
/// backend is `node`, whose backend is another).
pub fn broken(conns: &mut Vec<LongConn>, node: &str) -> (usize, usize) {
    let (mut of_node, mut others) = (0, 0);
    conns.retain_mut(|c| {
        let ok = c.ping().is_ok();
        if !ok {
            if c.backend == node {
                of_node += 1;
            } else {
                others += 1;
            }
        }
        ok
    });
    (of_node, others)
}

fn path(p: &Path) -> Result<&str> {
    p.to_str().context("non-UTF-8 path")
}
