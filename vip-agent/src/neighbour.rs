//! Backend MACs the config leaves out, read from the kernel's neighbour table (ARP
//! entries for IPv4 nodes, neighbour discovery's for IPv6 ones) over rtnetlink.
use std::{
    collections::BTreeMap,
    io,
    net::{IpAddr, Ipv4Addr, Ipv6Addr, UdpSocket},
};

use rtnetlink::{
    packet_core::{NetlinkHeader, NetlinkMessage, NetlinkPayload, NLM_F_DUMP, NLM_F_REQUEST},
    packet_route::{
        neighbour::{NeighbourAddress, NeighbourAttribute, NeighbourMessage, NeighbourState},
        RouteNetlinkMessage,
    },
    sys::{protocols::NETLINK_ROUTE, Socket, SocketAddr},
};

/// Resolved neighbours: address → MAC.
pub type Table = BTreeMap<IpAddr, [u8; 6]>;

/// The address and MAC of a usable entry: resolved (NUD_VALID, as /proc/net/arp's
/// "complete" flag: reachable, stale, delay, probe, permanent or noarp), with a
/// non-zero Ethernet address. Incomplete and failed entries have none to give.
pub fn usable(m: &NeighbourMessage) -> Option<(IpAddr, [u8; 6])> {
    use NeighbourState as S;
    if !matches!(m.header.state, S::Reachable | S::Stale | S::Delay | S::Probe | S::Permanent | S::Noarp) {
        return None;
    }
    let (mut addr, mut mac) = (None, None);
    for a in &m.attributes {
        match a {
            NeighbourAttribute::Destination(NeighbourAddress::Inet(v)) => addr = Some(IpAddr::V4(*v)),
            NeighbourAttribute::Destination(NeighbourAddress::Inet6(v)) => addr = Some(IpAddr::V6(*v)),
            NeighbourAttribute::LinkLayerAddress(l) => mac = <[u8; 6]>::try_from(l.as_slice()).ok(),
            _ => {}
        }
    }
    let mac = mac.filter(|m| *m != [0; 6])?;
    Some((addr?, mac))
}

/// This network namespace's neighbour table, both families, usable entries only
/// (empty when it cannot be read: nodes then stay unresolved, and say so).
pub fn table() -> Table {
    match dump() {
        Ok(t) => t,
        Err(e) => {
            tracing::warn!("reading the neighbour table over rtnetlink: {e}");
            Table::new()
        }
    }
}

/// One RTM_GETNEIGH dump on a blocking netlink socket (the agent calls this from
/// its blocking section, between map writes).
fn dump() -> io::Result<Table> {
    let mut sock = Socket::new(NETLINK_ROUTE)?;
    sock.bind_auto()?;
    sock.connect(&SocketAddr::new(0, 0))?;
    let mut header = NetlinkHeader::default();
    (header.flags, header.sequence_number) = (NLM_F_REQUEST | NLM_F_DUMP, 1);
    let mut req = NetlinkMessage::new(header, NetlinkPayload::from(RouteNetlinkMessage::GetNeighbour(NeighbourMessage::default())));
    req.finalize();
    let mut buf = vec![0; req.header.length as usize];
    req.serialize(&mut buf);
    sock.send(&buf, 0)?;
    let bad = |e: String| io::Error::new(io::ErrorKind::InvalidData, e);
    let mut table = Table::new();
    loop {
        let (data, _) = sock.recv_from_full()?;
        let mut at = 0;
        while at < data.len() {
            let msg = NetlinkMessage::<RouteNetlinkMessage>::deserialize(&data[at..]).map_err(|e| bad(format!("{e}")))?;
            let len = msg.header.length as usize;
            match msg.payload {
                NetlinkPayload::Done(_) => return Ok(table),
                NetlinkPayload::Error(e) => return Err(bad(format!("{e}"))),
                NetlinkPayload::InnerMessage(RouteNetlinkMessage::NewNeighbour(n)) => table.extend(usable(&n)),
                _ => {}
            }
            if len == 0 {
                return Err(bad("a netlink message of length 0".into()));
            }
            // Messages are 4-byte aligned (NLMSG_ALIGN).
            at += (len + 3) & !3;
        }
    }
}

/// Makes the kernel resolve `addr` (ARP, or a neighbour solicitation for an IPv6
/// node): one UDP datagram to the discard port. The health probes do the same for
/// checked backends; this covers unchecked ones.
pub fn solicit(addr: IpAddr) {
    let any: IpAddr = match addr {
        IpAddr::V4(_) => Ipv4Addr::UNSPECIFIED.into(),
        IpAddr::V6(_) => Ipv6Addr::UNSPECIFIED.into(),
    };
    if let Ok(s) = UdpSocket::bind((any, 0)) {
        let _ = s.send_to(&[], (addr, 9));
    }
}

#[cfg(test)]
mod tests {
    use rtnetlink::packet_route::AddressFamily;

    use super::*;

    fn entry(addr: NeighbourAddress, state: NeighbourState, mac: Option<&[u8]>) -> NeighbourMessage {
        let mut m = NeighbourMessage::default();
        m.header.family = match addr {
            NeighbourAddress::Inet(_) => AddressFamily::Inet,
            _ => AddressFamily::Inet6,
        };
        m.header.state = state;
        m.attributes.push(NeighbourAttribute::Destination(addr));
        m.attributes.extend(mac.map(|m| NeighbourAttribute::LinkLayerAddress(m.to_vec())));
        m
    }

    #[test]
    fn reads_resolved_entries_of_both_families() {
        let v4 = |s: &str| NeighbourAddress::Inet(s.parse().unwrap());
        let v6 = |s: &str| NeighbourAddress::Inet6(s.parse().unwrap());
        let mac = [2, 0, 0, 0, 0, 0x12];
        let ip = |s: &str| s.parse::<IpAddr>().unwrap();
        assert_eq!(usable(&entry(v4("198.18.0.12"), NeighbourState::Reachable, Some(&mac))), Some((ip("198.18.0.12"), mac)));
        assert_eq!(usable(&entry(v6("2001:2::12"), NeighbourState::Stale, Some(&mac))), Some((ip("2001:2::12"), mac)));
        for state in [NeighbourState::Delay, NeighbourState::Probe, NeighbourState::Permanent, NeighbourState::Noarp] {
            assert!(usable(&entry(v6("2001:2::12"), state, Some(&mac))).is_some(), "{state:?}");
        }
        for state in [NeighbourState::Incomplete, NeighbourState::Failed, NeighbourState::None] {
            assert_eq!(usable(&entry(v6("2001:2::12"), state, Some(&mac))), None, "{state:?}");
        }
        assert_eq!(usable(&entry(v6("2001:2::13"), NeighbourState::Reachable, None)), None, "no link-layer address");
        assert_eq!(usable(&entry(v4("198.18.0.13"), NeighbourState::Reachable, Some(&[0; 6]))), None, "a zero MAC");
        assert_eq!(usable(&entry(v4("198.18.0.13"), NeighbourState::Reachable, Some(&[1, 2, 3, 4]))), None, "not Ethernet");
    }

    /// The real table of this test's namespace: a dump that ends, whatever it holds.
    #[test]
    fn dumps_the_table() {
        dump().unwrap();
    }
}
