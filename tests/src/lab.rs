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

use crate::netns::{veth, NetNs};

/// The L2 segment: a namespace holding bridge `br0`; host `i` hangs on port `p{i}`.
pub struct Segment {
    pub ns: NetNs,
    /// Namespace name of the host on each bridge port, in port order.
    hosts: std::cell::RefCell<Vec<String>>,
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
    pub fn plug_as(&self, host: NetNs, iface: &str, addr: &str) -> Result<NetNs> {
        let port = format!("p{}", self.hosts.borrow().len());
        self.hosts.borrow_mut().push(host.name.clone());
        veth(&host, iface, &self.ns, &port)?;
        self.ns.ip(&["link", "set", &port, "master", "br0"])?;
        host.ip(&["addr", "add", addr, "dev", iface])?;
        Ok(host)
    }

    /// Cuts `host` off the segment (or joins it again) while its link stays up:
    /// its bridge port is set to the STP state "disabled" (forwarding again), which
    /// drops every frame through it both ways, so the host keeps its carrier and
    /// sees a silent network: a partition rather than a lost NIC.
    pub fn isolate(&self, host: &NetNs, cut: bool) -> Result<()> {
        let i = self.hosts.borrow().iter().position(|h| *h == host.name).context("host not on this segment")?;
        let state = if cut { "0" } else { "3" };
        let o = self.ns.cmd("bridge").args(["link", "set", "dev", &format!("p{i}"), "state", state]).output()?;
        anyhow::ensure!(o.status.success(), "bridge link set p{i} state {state}: {}", String::from_utf8_lossy(&o.stderr));
        Ok(())
    }

    /// Pulls (or plugs back) the cable of `host`: its bridge port goes down (up),
    /// and with it the carrier of the host's eth0.
    pub fn cable(&self, host: &NetNs, up: bool) -> Result<()> {
        let i = self.hosts.borrow().iter().position(|h| *h == host.name).context("host not on this segment")?;
        self.ns.ip(&["link", "set", &format!("p{i}"), if up { "up" } else { "down" }])?;
        Ok(())
    }
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

/// Loads the program with its maps pinned under `dir` and attaches it (generic
/// mode: native XDP_TX on veth needs a program on the peer) to `host`'s eth0.
/// Returns the facade and eth0's ifindex.
pub fn attach_node(host: &NetNs, dir: &std::path::Path) -> Result<(vip_agent::dataplane::Dataplane, u32)> {
    let dir = dir.to_owned();
    host.run(move || -> Result<_> {
        let mut dp = vip_agent::dataplane::Dataplane::load(&dir, 1 << 16)?;
        let a = dp.attach("eth0", vip_agent::dataplane::AttachMode::Generic)?;
        Ok((dp, a.ifindex))
    })?
}
