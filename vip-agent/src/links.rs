//! Where each pool's VIPs live on this node: the interface that answers for them
//! (and, for a VLAN sub-interface, the parent the XDP program runs on and the VLAN
//! id). `read_host` reads the host's interfaces; `resolve` is a pure function of the
//! model and that list, so every rule is tested without a network.
use std::{
    collections::BTreeMap,
    ffi::CStr,
    io,
    net::{IpAddr, Ipv4Addr, Ipv6Addr},
};

use anyhow::Context as _;

use crate::model::{Node, Pool, World};

/// An interface of this host, as the resolver needs it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HostIface {
    pub name: String,
    pub ifindex: u32,
    /// All zeros for interfaces without a hardware address (lo, tunnels).
    pub mac: [u8; 6],
    /// IPv4 and IPv6 addresses with their prefix lengths (IPv6 link-local ones
    /// left out: every interface has one, and they name no network).
    pub nets: Vec<(IpAddr, u8)>,
    /// For an 802.1Q sub-interface: its parent's name and the VLAN id.
    pub vlan: Option<(String, u16)>,
    /// Administratively up with carrier (IFF_UP and IFF_RUNNING).
    pub up: bool,
}

/// The kernel's list of VLAN devices of the reader's network namespace. Through
/// `thread-self`: `/proc/self/net` (and `/proc/net`) would show the namespace of
/// the process's main thread, not of a thread that entered another one.
const VLAN_CONFIG: &str = "/proc/thread-self/net/vlan/config";

/// Reads the host's interfaces in the calling thread's network namespace: getifaddrs
/// (libc) for names, ifindex, MAC (AF_PACKET entries) and IPv4 and IPv6 addresses
/// with netmasks; /proc/net/vlan/config for 802.1Q sub-interfaces ("name | vid |
/// parent" lines; absent file = no VLAN devices). Interfaces without addresses are
/// included too. Sorted by ifindex.
pub fn read_host() -> anyhow::Result<Vec<HostIface>> {
    let entries = if_addrs().context("getifaddrs")?;
    let vlans = match std::fs::read_to_string(VLAN_CONFIG) {
        Ok(text) => parse_vlan_config(&text),
        // No 8021q module: no VLAN devices.
        Err(e) if e.kind() == io::ErrorKind::NotFound => BTreeMap::new(),
        Err(e) => return Err(e).with_context(|| format!("reading {VLAN_CONFIG} (VLAN devices)")),
    };
    let mut ifaces: Vec<HostIface> = entries
        .iter()
        .filter_map(|e| match e {
            Entry::Link { name, ifindex, mac, up } => {
                Some(HostIface { name: name.clone(), ifindex: *ifindex, mac: *mac, nets: Vec::new(), vlan: vlans.get(name).cloned(), up: *up })
            }
            Entry::Inet { .. } => None,
        })
        .collect();
    for e in &entries {
        let Entry::Inet { name, addr, prefix } = e else { continue };
        // An IPv4 entry carries the address's label: the device name, or the device
        // name, ':' and a suffix (`eth0:1`, ifconfig's aliases). Device names have no ':'.
        let device = name.split(':').next().unwrap_or(name);
        if let Some(i) = ifaces.iter_mut().find(|i| i.name == *name || i.name == device) {
            i.nets.push((*addr, *prefix));
        }
    }
    ifaces.sort_by_key(|i| i.ifindex);
    Ok(ifaces)
}

/// `/proc/net/vlan/config`: two header lines, then `name | vid | parent` per VLAN device.
fn parse_vlan_config(text: &str) -> BTreeMap<String, (String, u16)> {
    text.lines()
        .filter_map(|line| {
            let mut f = line.split('|').map(str::trim);
            let (name, vid, parent) = (f.next()?, f.next()?, f.next()?);
            let vid = vid.parse().ok()?;
            (!name.is_empty() && !parent.is_empty()).then(|| (name.to_owned(), (parent.to_owned(), vid)))
        })
        .collect()
}

/// One getifaddrs entry we use.
enum Entry {
    Link { name: String, ifindex: u32, mac: [u8; 6], up: bool },
    Inet { name: String, addr: IpAddr, prefix: u8 },
}

/// The AF_PACKET, AF_INET and AF_INET6 (but link-local) entries of getifaddrs,
/// copied out of libc's list.
fn if_addrs() -> io::Result<Vec<Entry>> {
    struct List(*mut libc::ifaddrs);
    impl Drop for List {
        fn drop(&mut self) {
            // SAFETY: the list getifaddrs returned, freed once.
            unsafe { libc::freeifaddrs(self.0) }
        }
    }
    let mut head = std::ptr::null_mut();
    // SAFETY: getifaddrs writes a list head we own until freeifaddrs (List's Drop).
    if unsafe { libc::getifaddrs(&mut head) } != 0 {
        return Err(io::Error::last_os_error());
    }
    let list = List(head);
    let mut out = Vec::new();
    let mut p = list.0;
    while !p.is_null() {
        // SAFETY: every node of the list, its NUL-terminated name and its addresses
        // stay valid until freeifaddrs. A non-null ifa_addr/ifa_netmask points to a
        // sockaddr of the family in sa_family, allocated by libc at least as large as
        // that family's struct (glibc and musl use a union of sockaddr types); read
        // unaligned, as a `struct sockaddr *` promises no more than its own alignment.
        let ifa = unsafe { &*p };
        p = ifa.ifa_next;
        if ifa.ifa_addr.is_null() {
            continue;
        }
        let name = unsafe { CStr::from_ptr(ifa.ifa_name) }.to_string_lossy().into_owned();
        let family = unsafe { std::ptr::read_unaligned(ifa.ifa_addr) }.sa_family as libc::c_int;
        match family {
            libc::AF_PACKET => {
                let ll = unsafe { std::ptr::read_unaligned(ifa.ifa_addr as *const libc::sockaddr_ll) };
                let mut mac = [0u8; 6];
                if ll.sll_halen == 6 {
                    mac.copy_from_slice(&ll.sll_addr[..6]);
                }
                let running = (libc::IFF_UP | libc::IFF_RUNNING) as libc::c_uint;
                out.push(Entry::Link { name, ifindex: ll.sll_ifindex as u32, mac, up: ifa.ifa_flags & running == running });
            }
            libc::AF_INET => {
                let v4 = |sa: *const libc::sockaddr| {
                    let sin = unsafe { std::ptr::read_unaligned(sa as *const libc::sockaddr_in) };
                    u32::from_be(sin.sin_addr.s_addr)
                };
                let addr = Ipv4Addr::from(v4(ifa.ifa_addr)).into();
                let mask = if ifa.ifa_netmask.is_null() { u32::MAX } else { v4(ifa.ifa_netmask) };
                out.push(Entry::Inet { name, addr, prefix: mask.count_ones() as u8 });
            }
            libc::AF_INET6 => {
                let v6 = |sa: *const libc::sockaddr| {
                    let sin6 = unsafe { std::ptr::read_unaligned(sa as *const libc::sockaddr_in6) };
                    u128::from_be_bytes(sin6.sin6_addr.s6_addr)
                };
                let addr = Ipv6Addr::from(v6(ifa.ifa_addr));
                if is_link_local(addr) {
                    continue;
                }
                let mask = if ifa.ifa_netmask.is_null() { u128::MAX } else { v6(ifa.ifa_netmask) };
                out.push(Entry::Inet { name, addr: addr.into(), prefix: mask.count_ones() as u8 });
            }
            _ => {}
        }
    }
    Ok(out)
}

/// Where a pool's VIPs live on this node.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Link {
    /// The chosen interface (a VLAN sub-interface's own name, e.g. `eth0.100`).
    pub name: String,
    pub ifindex: u32,
    pub mac: [u8; 6],
    /// the interface the XDP program runs on: the VLAN's parent, or the interface itself
    pub xdp_iface: String,
    pub xdp_ifindex: u32,
    /// The VLAN id of the chosen interface, when it is an 802.1Q sub-interface.
    pub vlan: Option<u16>,
}

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Links {
    /// Pool name → its link on this node.
    pub by_pool: BTreeMap<String, Link>,
    /// one message per pool that admits this node but has no usable interface here
    pub problems: Vec<String>,
}

/// The loopback: never chosen by address (backends hold VIPs there, and
/// `announce: lo` holders too), only when named.
const LOOPBACK: &str = "lo";

/// Where each pool that admits node `me` answers its VIPs on this node. No such
/// node: nothing. For each pool, the first rule that applies:
/// 1. `pool.interfaces` non-empty: the first listed name this host has (names
///    differ between nodes: a pool lists every name, as MetalLB's L2Advertisement
///    `interfaces`); none here is a problem;
/// 2. `default_iface` (the agent's `--iface`), when given; missing is a problem;
/// 3. automatic (PureLB's rule): the interface with the longest prefix that
///    contains the pool's first IPv4 address, else its first IPv6 address (link-local
///    networks aside), ties broken by name so every run agrees;
/// 4. the interface holding the node's own address (`Node.addr`), by name if several;
/// 5. otherwise a problem.
///
/// `lo` is never chosen by rules 3 and 4. A VLAN sub-interface runs XDP on its
/// parent (`xdp_*`, `vlan`); a VLAN on a VLAN (QinQ) or a VLAN whose parent is not
/// here is a problem. An interface that is down is chosen all the same: link state
/// is the agent's liveness thread's to watch, and a choice that followed it would
/// move a pool's VIPs to another network when a cable is pulled.
pub fn resolve(world: &World, me: &str, default_iface: Option<&str>, host: &[HostIface]) -> Links {
    let mut links = Links::default();
    let Some(node) = world.node(me) else { return links };
    for pool in world.pools.iter().filter(|p| p.admits(node)) {
        match choose(pool, node, default_iface, host).and_then(|i| link(i, host)).and_then(|l| on_vlan(l, pool.vlan)) {
            Ok(l) => {
                links.by_pool.insert(pool.name.clone(), l);
            }
            Err(why) => links.problems.push(format!("pool {:?}: {why}", pool.name)),
        }
    }
    links
}

/// Network ids of VLANs a pool names (`vlan:`) without a sub-interface on the
/// node: held VIPs are keyed by them as by an ifindex. Real ifindices are
/// positive `int`s, so ids with the top bit set never clash with one.
const VLAN_NET: u32 = 1 << 31;

/// The network id of VLAN `vid` on the interface `parent` (see [`VLAN_NET`]).
pub fn vlan_net(parent: u32, vid: u16) -> u32 {
    VLAN_NET | (parent & 0x7_ffff) << 12 | u32::from(vid & 0x0fff)
}

/// Whether `ifindex` is a [`vlan_net`] id rather than an interface's.
pub fn is_vlan_net(ifindex: u32) -> bool {
    ifindex & VLAN_NET != 0
}

/// A held VIP's network for people: the interface's name (`eth0`, `eth0.30`), or
/// for a [`vlan_net`] id `eth0 VLAN 30`; an index no interface has here as a number.
pub fn network_name(ifindex: u32) -> String {
    let name = |i: u32| {
        let mut buf = [0 as libc::c_char; libc::IF_NAMESIZE];
        // SAFETY: a buffer of IF_NAMESIZE, as if_indextoname requires; on success it
        // holds a NUL-terminated name.
        let p = unsafe { libc::if_indextoname(i, buf.as_mut_ptr()) };
        (!p.is_null()).then(|| unsafe { std::ffi::CStr::from_ptr(buf.as_ptr()) }.to_string_lossy().into_owned())
    };
    if is_vlan_net(ifindex) {
        let (parent, vid) = ((ifindex & !VLAN_NET) >> 12, ifindex & 0x0fff);
        return format!("{} VLAN {vid}", name(parent).unwrap_or_else(|| parent.to_string()));
    }
    name(ifindex).unwrap_or_else(|| ifindex.to_string())
}

/// Why a pool, or the node's home, has no interface here.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum LinkError {
    #[error("none of its interfaces ({}) is on this node", .0.join(", "))]
    NoneOfInterfaces(Vec<String>),
    #[error("the agent's interface {0:?} (--iface) is not on this node")]
    NoDefault(String),
    /// `first`: the pool's first address.
    #[error("no interface of this node has a network containing {first} or the node's address {node}; list the pool's interfaces or set the agent's --iface")]
    NoNetwork { first: String, node: IpAddr },
    #[error("no interface of this node holds its address {0}; set the agent's --iface")]
    NoHome(IpAddr),
    #[error("the parent {parent:?} of VLAN interface {iface:?} is not on this node")]
    NoParent { parent: String, iface: String },
    #[error("{iface:?} is a VLAN on the VLAN interface {parent:?} (stacked tags): QinQ is not supported")]
    StackedVlan { iface: String, parent: String },
    #[error("vlan {vlan} contradicts {iface:?}, a sub-interface of VLAN {has}")]
    VlanContradicts { vlan: u16, iface: String, has: u16 },
}

/// `l` put on the pool's `vlan`, if it names one: the VLAN of the chosen
/// interface, a network of its own (see [`vlan_net`]). A VLAN sub-interface of
/// another VLAN id contradicts it.
fn on_vlan(l: Link, vlan: Option<u16>) -> Result<Link, LinkError> {
    match (vlan, l.vlan) {
        (None, _) => Ok(l),
        (Some(v), Some(w)) if v == w => Ok(l),
        (Some(v), Some(w)) => Err(LinkError::VlanContradicts { vlan: v, iface: l.name, has: w }),
        (Some(v), None) => Ok(Link { name: format!("{}.{v}", l.name), ifindex: vlan_net(l.xdp_ifindex, v), vlan: Some(v), ..l }),
    }
}

fn find<'a>(host: &'a [HostIface], name: &str) -> Option<&'a HostIface> {
    host.iter().find(|i| i.name == name)
}

/// fe80::/10.
pub(crate) fn is_link_local(a: Ipv6Addr) -> bool {
    a.segments()[0] & 0xffc0 == 0xfe80
}

/// Whether network `(net, len)` contains `a`; never across families.
pub(crate) fn contains((net, len): (IpAddr, u8), a: IpAddr) -> bool {
    // Both as the high bits of a u128, so that one mask serves both families.
    let (bits, net, a) = match (net, a) {
        (IpAddr::V4(n), IpAddr::V4(a)) => (32, u128::from(u32::from(n)) << 96, u128::from(u32::from(a)) << 96),
        (IpAddr::V6(n), IpAddr::V6(a)) => (128, u128::from(n), u128::from(a)),
        _ => return false,
    };
    let mask = match len {
        0 => 0,
        l if l <= bits => u128::MAX << (128 - u32::from(l)),
        _ => return false,
    };
    net & mask == a & mask
}

/// Rules 1 to 5 of [`resolve`].
fn choose<'a>(pool: &Pool, node: &Node, default_iface: Option<&str>, host: &'a [HostIface]) -> Result<&'a HostIface, LinkError> {
    if !pool.interfaces.is_empty() {
        return pool.interfaces.iter().find_map(|n| find(host, n)).ok_or_else(|| LinkError::NoneOfInterfaces(pool.interfaces.clone()));
    }
    if let Some(name) = default_iface {
        return named_default(host, name);
    }
    let candidates = || host.iter().filter(|i| i.name != LOOPBACK);
    // The first IPv4 address, then the first IPv6 one (a dual-stack pool's IPv4
    // networks decide, as before IPv6 networks were read).
    let firsts = [pool.addresses.iter().find(|a| a.is_ipv4()), pool.addresses.iter().find(|a| a.is_ipv6())];
    for &first in firsts.into_iter().flatten() {
        let longest = |i: &'a HostIface| i.nets.iter().filter(|&&n| contains(n, first)).map(|&(_, len)| len).max().map(|len| (len, i));
        // The longest prefix; among equals the first name (max_by keeps the last maximum).
        if let Some((_, i)) = candidates().filter_map(longest).max_by(|(la, a), (lb, b)| la.cmp(lb).then_with(|| b.name.cmp(&a.name))) {
            return Ok(i);
        }
    }
    holding(host, node.addr).ok_or_else(|| {
        let first = pool.addresses.first().map_or_else(|| "its addresses".to_owned(), |a| a.to_string());
        LinkError::NoNetwork { first, node: node.addr }
    })
}

/// The agent's `--iface` on `host`, or why not.
fn named_default<'a>(host: &'a [HostIface], name: &str) -> Result<&'a HostIface, LinkError> {
    find(host, name).ok_or_else(|| LinkError::NoDefault(name.to_owned()))
}

/// The interface holding address `addr`, never `lo`; the first by name if several
/// (rule 4 of [`resolve`], and a node's home).
fn holding(host: &[HostIface], addr: IpAddr) -> Option<&HostIface> {
    host.iter().filter(|i| i.name != LOOPBACK && i.nets.iter().any(|&(a, _)| a == addr)).min_by(|a, b| a.name.cmp(&b.name))
}

/// Where a node with address `addr` is reached (its home): `default_iface` when
/// given, else the interface holding `addr`.
pub fn home(addr: IpAddr, default_iface: Option<&str>, host: &[HostIface]) -> Result<Link, LinkError> {
    let found = match default_iface {
        Some(name) => named_default(host, name)?,
        None => holding(host, addr).ok_or(LinkError::NoHome(addr))?,
    };
    link(found, host)
}

/// An interface of `host` as a link: XDP on it, or on its parent if it is an
/// 802.1Q sub-interface (a VLAN on a VLAN, or a parent not in `host`, is an error).
pub fn link(i: &HostIface, host: &[HostIface]) -> Result<Link, LinkError> {
    let (xdp, vlan) = match &i.vlan {
        None => (i, None),
        Some((parent, vid)) => {
            let p = find(host, parent).ok_or_else(|| LinkError::NoParent { parent: parent.clone(), iface: i.name.clone() })?;
            if p.vlan.is_some() {
                return Err(LinkError::StackedVlan { iface: i.name.clone(), parent: p.name.clone() });
            }
            (p, Some(*vid))
        }
    };
    Ok(Link { name: i.name.clone(), ifindex: i.ifindex, mac: i.mac, xdp_iface: xdp.name.clone(), xdp_ifindex: xdp.ifindex, vlan })
}

#[cfg(test)]
mod tests;
