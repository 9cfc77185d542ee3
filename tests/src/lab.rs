//! Building blocks of the lab, shared by the end-to-end tests and `vip-lab`: an
//! L2 segment (a bridge in its own namespace), hosts plugged into it, a TCP
//! server that answers its name, and a client that connects from a chosen port.
use std::{
    io::{Read, Write},
    net::{Ipv4Addr, SocketAddr, TcpListener},
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc,
    },
    thread::JoinHandle,
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result};

use vip_agent::dataplane::AttachMode;

use crate::netns::{attach_xdp_pass, ethtool_features, veth, NetNs};

/// The L2 segment: a namespace holding bridge `br0`; host `i` hangs on port `p{i}`.
pub struct Segment {
    pub ns: NetNs,
    /// Namespace name of the host on each bridge port, in port order.
    hosts: std::sync::Mutex<Vec<String>>,
}

impl Segment {
    pub fn new() -> Result<Self> {
        Self::in_ns(NetNs::new("vbr")?)
    }

    /// The segment in namespace `ns` (a fixed name for the persistent lab).
    pub fn in_ns(ns: NetNs) -> Result<Self> {
        ns.ip(&["link", "add", "br0", "type", "bridge"])?;
        ns.ip(&["link", "set", "br0", "up"])?;
        Ok(Self { ns, hosts: Default::default() })
    }

    /// A new namespace with `eth0` on the segment, addressed `addr` (CIDR).
    pub fn host(&self, prefix: &str, addr: &str) -> Result<NetNs> {
        self.plug(NetNs::new(prefix)?, addr)
    }

    /// Plugs `host` into the segment: `eth0` on a new bridge port, addressed `addr` (CIDR).
    pub fn plug(&self, host: NetNs, addr: &str) -> Result<NetNs> {
        self.plug_as(host, "eth0", addr)
    }

    /// [`Self::plug`] with the host's end named `iface` (a host on two segments).
    ///
    /// Both ends are set up so that the segment behaves like a switch and wires
    /// for XDP in either attach mode (see [`wire_port`] and [`wire_host`]).
    pub fn plug_as(&self, host: NetNs, iface: &str, addr: &str) -> Result<NetNs> {
        let port = {
            let mut hosts = self.hosts.lock().unwrap();
            hosts.push(host.name.clone());
            format!("p{}", hosts.len() - 1)
        };
        veth(&host, iface, &self.ns, &port)?;
        self.ns.ip(&["link", "set", &port, "master", "br0"])?;
        wire_port(&self.ns, &port)?;
        wire_host(&host, iface)?;
        // The lab hands out unique addresses: duplicate address detection would only
        // leave an IPv6 one tentative (unbindable) for a second or two.
        let nodad: &[&str] = if addr.contains(':') { &["nodad"] } else { &[] };
        host.ip(&[&["addr", "add", addr, "dev", iface][..], nodad].concat())?;
        Ok(host)
    }

    /// Starts counting frames the segment carries to `dst` (an nftables address or
    /// prefix) with a TTL below 64: routed by a host on it, not sent by a client
    /// on it. A node's stack that routes a VIP's frame back to the holder shows
    /// here ([`Self::routed_count`]).
    pub fn count_routed(&self, dst: &str) -> Result<()> {
        self.ns.nft(&["add", "table", "bridge", "vipwatch"])?;
        self.ns.nft(&["add", "chain", "bridge", "vipwatch", "routed", "{ type filter hook forward priority 0 ; }"])?;
        self.ns.nft(&["add", "rule", "bridge", "vipwatch", "routed", "ip", "daddr", dst, "ip", "ttl", "lt", "64", "counter"])?;
        Ok(())
    }

    /// Frames counted since [`Self::count_routed`].
    pub fn routed_count(&self) -> Result<u64> {
        let text = self.ns.nft(&["list", "chain", "bridge", "vipwatch", "routed"])?;
        crate::netns::nft_packets(&text).with_context(|| format!("no counter in {text}"))
    }

    fn port_of(&self, host: &NetNs) -> Result<usize> {
        self.hosts.lock().unwrap().iter().position(|h| *h == host.name).context("host not on this segment")
    }

    /// Cuts `host` off the segment (or joins it again) while its link stays up:
    /// its bridge port is set to the STP state "disabled" (forwarding again), which
    /// drops every frame through it both ways, so the host keeps its carrier and
    /// sees a silent network: a partition rather than a lost NIC.
    pub fn isolate(&self, host: &NetNs, cut: bool) -> Result<()> {
        let i = self.port_of(host)?;
        let state = if cut { "0" } else { "3" };
        let o = self.ns.cmd("bridge").args(["link", "set", "dev", &format!("p{i}"), "state", state]).output()?;
        anyhow::ensure!(o.status.success(), "bridge link set p{i} state {state}: {}", String::from_utf8_lossy(&o.stderr));
        Ok(())
    }

    /// Pulls (or plugs back) the cable of `host`: its bridge port goes down (up),
    /// and with it the carrier of the host's eth0.
    pub fn cable(&self, host: &NetNs, up: bool) -> Result<()> {
        let i = self.port_of(host)?;
        self.ns.ip(&["link", "set", &format!("p{i}"), if up { "up" } else { "down" }])?;
        Ok(())
    }
}

/// The switch side of a veth "wire" (a bridge port, or the far end of a point-to-point
/// pair): what the host's end needs from it to behave like a real NIC's link.
/// - A trivial XDP_PASS program in native mode: a host's *native* XDP_TX (ARP replies,
///   forwards) on a veth is delivered promptly only when this end has an XDP
///   program of its own ([`attach_xdp_pass`]). GRO on this end is not enough: it
///   gives the end NAPI, so XDP_TX frames are queued, but nothing wakes that NAPI
///   for them; they wait until other traffic does (never, or up to the next
///   health check, in the lab).
/// - No VLAN tag insertion offload: a tag the bridge puts on a frame for this port
///   leaves inside the frame, as on a wire to a NIC without rx VLAN stripping,
///   instead of in skb metadata, where XDP on the host's end (generic or native)
///   would never see it.
pub fn wire_port(ns: &NetNs, port: &str) -> Result<()> {
    attach_xdp_pass(ns, port)?;
    ethtool_features(ns, port, &["txvlan", "off", "tx-vlan-stag-hw-insert", "off"])
}

/// The host's end of a veth wire: checksums computed in software when sending.
/// With TX checksum offload (a veth's default) the stack sends TCP and UDP with
/// only the pseudo-header sum in the checksum field (CHECKSUM_PARTIAL) and the
/// promise to finish it in skb metadata; generic XDP forwards that skb with the
/// metadata, but native XDP_TX turns the packet into a bare frame and the promise
/// is lost, so the backend drops every forwarded segment (TcpInCsumErrors). A real
/// NIC finishes the checksum before the wire. Done on every host, not only the
/// client: any host may send to a VIP, and every host then sends what a wire carries.
pub fn wire_host(ns: &NetNs, iface: &str) -> Result<()> {
    ethtool_features(ns, iface, &["tx", "off"])
}

/// The XDP attach mode of the labs: `VIP_XDP_MODE=native|generic` (default
/// generic), read here only; every lab that attaches the program (directly, or
/// through `vip-agent run --mode`) follows it. An unknown value fails.
pub fn xdp_mode() -> AttachMode {
    match std::env::var("VIP_XDP_MODE").as_deref() {
        Err(_) | Ok("") | Ok("generic") => AttachMode::Generic,
        Ok("native") => AttachMode::Native,
        Ok(other) => panic!("VIP_XDP_MODE={other}: expected native or generic"),
    }
}

/// `mode` as `vip-agent run --mode` spells it, logged (shown with a failing
/// test's output, and with --nocapture): every lab that attaches says how.
pub fn mode_arg(mode: AttachMode, what: &str) -> &'static str {
    let arg = match mode {
        AttachMode::Native => "native",
        AttachMode::Generic => "generic",
        AttachMode::Auto => "auto",
    };
    eprintln!("lab: {what}: XDP attached in {arg} mode");
    arg
}

/// [`xdp_mode`] as `vip-agent run --mode` spells it (logged).
pub fn xdp_mode_arg() -> &'static str {
    mode_arg(xdp_mode(), "the agent (VIP_XDP_MODE)")
}

/// Makes `host` accept `vip` (on lo, as kube-proxy would) without ever
/// answering ARP for it: the backend side of L2 direct server return.
pub fn accept_vip(host: &NetNs, vip: Ipv4Addr) -> Result<()> {
    host.ip(&["addr", "add", &format!("{vip}/32"), "dev", "lo"])?;
    host.sysctl("net.ipv4.conf.all.arp_ignore", "1")?;
    host.sysctl("net.ipv4.conf.all.arp_announce", "2")
}

/// A TCP server in `ns` on `port` answering `name` to each connection until
/// `stop` (or 120 s). Returns how many connections it served.
pub fn name_server(ns: &NetNs, port: u16, name: String, stop: Arc<AtomicBool>) -> Result<JoinHandle<u32>> {
    ns.spawn(move || {
        let l = TcpListener::bind(("0.0.0.0", port)).expect("bind name server");
        l.set_nonblocking(true).expect("nonblocking");
        let mut served = 0;
        let deadline = Instant::now() + Duration::from_secs(120);
        while !stop.load(Ordering::Relaxed) && Instant::now() < deadline {
            match l.accept() {
                Ok((mut s, _)) => {
                    let _ = s.set_nonblocking(false);
                    let _ = s.write_all(name.as_bytes());
                    served += 1;
                }
                Err(_) => std::thread::sleep(Duration::from_millis(2)),
            }
        }
        served
    })
}

/// Connects from `src`:`sport` to `dst` (3 s timeouts) and reads the answer.
pub fn fetch(src: Ipv4Addr, sport: u16, dst: SocketAddr) -> std::io::Result<String> {
    let s = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None)?;
    s.set_reuse_address(true)?;
    s.bind(&SocketAddr::from((src, sport)).into())?;
    s.connect_timeout(&dst.into(), Duration::from_secs(3))?;
    s.set_read_timeout(Some(Duration::from_secs(3)))?;
    let mut t: std::net::TcpStream = s.into();
    let mut out = String::new();
    t.read_to_string(&mut out)?;
    Ok(out)
}

/// Loads the program with its maps pinned under `dir` and attaches it to `host`'s
/// eth0 in the lab's mode ([`xdp_mode`]). Returns the facade and eth0's ifindex.
pub fn attach_node(host: &NetNs, dir: &std::path::Path) -> Result<(vip_agent::dataplane::Dataplane, u32)> {
    attach_node_in(host, dir, xdp_mode())
}

/// [`attach_node`] in `mode` (the benchmarks measure both in one run).
pub fn attach_node_in(host: &NetNs, dir: &std::path::Path, mode: AttachMode) -> Result<(vip_agent::dataplane::Dataplane, u32)> {
    let dir = dir.to_owned();
    mode_arg(mode, &host.name);
    host.run(move || -> Result<_> {
        let mut dp = vip_agent::dataplane::Dataplane::load(&dir, 1 << 16)?;
        let a = dp.attach("eth0", mode)?;
        anyhow::ensure!(a.mode == Some(mode), "eth0 attached in {:?}, not {mode:?}", a.mode);
        Ok((dp, a.ifindex))
    })?
}
