//! Frame builders for fixtures: Ethernet (optionally one 802.1Q tag), ARP, IPv4
//! TCP/UDP/ICMP, fragments, IPv6 neighbour discovery, ICMP and ICMPv6 errors.
//! Checksums are real so captures read cleanly.
use std::net::{Ipv4Addr, Ipv6Addr};

pub type Mac = [u8; 6];
pub const BROADCAST: Mac = [0xff; 6];

fn csum(data: &[u8]) -> u16 {
    let mut s: u32 = data.chunks(2).map(|c| u32::from(u16::from_be_bytes([c[0], *c.get(1).unwrap_or(&0)]))).sum();
    while s > 0xffff {
        s = (s & 0xffff) + (s >> 16);
    }
    !(s as u16)
}

/// Ethernet header with an optional VLAN id.
pub fn eth(dst: Mac, src: Mac, vlan: Option<u16>, ethertype: u16) -> Vec<u8> {
    let mut f = Vec::with_capacity(64);
    f.extend_from_slice(&dst);
    f.extend_from_slice(&src);
    if let Some(v) = vlan {
        f.extend_from_slice(&0x8100u16.to_be_bytes());
        f.extend_from_slice(&(v & 0x0fff).to_be_bytes());
    }
    f.extend_from_slice(&ethertype.to_be_bytes());
    f
}

/// An ARP packet (op 1 request, 2 reply) in an Ethernet frame.
pub fn arp(dst: Mac, vlan: Option<u16>, op: u16, sha: Mac, spa: Ipv4Addr, tha: Mac, tpa: Ipv4Addr) -> Vec<u8> {
    let mut f = eth(dst, sha, vlan, 0x0806);
    f.extend_from_slice(&[0, 1, 8, 0, 6, 4]);
    f.extend_from_slice(&op.to_be_bytes());
    f.extend_from_slice(&sha);
    f.extend_from_slice(&spa.octets());
    f.extend_from_slice(&tha);
    f.extend_from_slice(&tpa.octets());
    f
}

pub fn arp_request(sha: Mac, spa: Ipv4Addr, tpa: Ipv4Addr, vlan: Option<u16>) -> Vec<u8> {
    arp(BROADCAST, vlan, 1, sha, spa, [0; 6], tpa)
}

/// The RFC 826 reply `our_mac` owes to `request` (same VLAN tag).
pub fn arp_reply_for(request: &[u8], our_mac: Mac) -> Vec<u8> {
    let off = if request[12..14] == [0x81, 0x00] { 18 } else { 14 };
    let a = &request[off..off + 28];
    let (sha, spa, tpa) = (&a[8..14], &a[14..18], &a[24..28]);
    let mut r = request.to_vec();
    r[0..6].copy_from_slice(sha);
    r[6..12].copy_from_slice(&our_mac);
    let b = &mut r[off..off + 28];
    b[6..8].copy_from_slice(&2u16.to_be_bytes());
    b[8..14].copy_from_slice(&our_mac);
    b[14..18].copy_from_slice(tpa);
    b[18..24].copy_from_slice(sha);
    b[24..28].copy_from_slice(spa);
    r
}

#[derive(Clone, Copy, Debug)]
pub struct Ip4 {
    pub src: Ipv4Addr,
    pub dst: Ipv4Addr,
    pub proto: u8,
    /// Fragment offset in 8-byte units and the more-fragments flag.
    pub frag_offset: u16,
    pub more_fragments: bool,
    pub id: u16,
}

impl Ip4 {
    pub fn new(src: Ipv4Addr, dst: Ipv4Addr, proto: u8) -> Self {
        Self { src, dst, proto, frag_offset: 0, more_fragments: false, id: 1 }
    }
}

/// An IPv4 packet with `payload` (an L4 header and data) in an Ethernet frame.
pub fn ipv4(dst_mac: Mac, src_mac: Mac, vlan: Option<u16>, ip: Ip4, payload: &[u8]) -> Vec<u8> {
    let mut f = eth(dst_mac, src_mac, vlan, 0x0800);
    let mut h = [0u8; 20];
    h[0] = 0x45;
    h[2..4].copy_from_slice(&((20 + payload.len()) as u16).to_be_bytes());
    h[4..6].copy_from_slice(&ip.id.to_be_bytes());
    let frags = (ip.frag_offset & 0x1fff) | if ip.more_fragments { 0x2000 } else { 0 };
    h[6..8].copy_from_slice(&frags.to_be_bytes());
    h[8] = 64;
    h[9] = ip.proto;
    h[12..16].copy_from_slice(&ip.src.octets());
    h[16..20].copy_from_slice(&ip.dst.octets());
    let c = csum(&h);
    h[10..12].copy_from_slice(&c.to_be_bytes());
    f.extend_from_slice(&h);
    // A whole TCP or UDP datagram gets its checksum, so that a stack takes it.
    let mut payload = payload.to_vec();
    let at = match ip.proto {
        6 if payload.len() >= 20 => Some(16),
        17 if payload.len() >= 8 => Some(6),
        _ => None,
    };
    if let Some(at) = at.filter(|_| ip.frag_offset == 0 && !ip.more_fragments) {
        let mut pseudo = Vec::with_capacity(12 + payload.len() + 1);
        pseudo.extend_from_slice(&ip.src.octets());
        pseudo.extend_from_slice(&ip.dst.octets());
        pseudo.extend_from_slice(&[0, ip.proto]);
        pseudo.extend_from_slice(&(payload.len() as u16).to_be_bytes());
        pseudo.extend_from_slice(&payload);
        if pseudo.len() % 2 == 1 {
            pseudo.push(0);
        }
        let c = csum(&pseudo);
        payload[at..at + 2].copy_from_slice(&c.to_be_bytes());
    }
    f.extend_from_slice(&payload);
    f
}

/// `frame` (an IPv4 frame, untagged or with one tag) with `words` 4-byte words of
/// IP options (NOPs) inserted after its 20-byte header; IHL, total length and
/// checksum adjusted.
pub fn with_ip_options(frame: &[u8], words: u8) -> Vec<u8> {
    let l2 = if frame[12..14] == [0x81, 0x00] { 18 } else { 14 };
    let mut f = frame[..l2 + 20].to_vec();
    f.extend(std::iter::repeat_n(1u8, 4 * words as usize));
    f.extend_from_slice(&frame[l2 + 20..]);
    let h = &mut f[l2..l2 + 20 + 4 * words as usize];
    h[0] = 0x45 + words;
    let tot = u16::from_be_bytes([h[2], h[3]]) + 4 * u16::from(words);
    h[2..4].copy_from_slice(&tot.to_be_bytes());
    h[10..12].copy_from_slice(&[0, 0]);
    let c = csum(h);
    h[10..12].copy_from_slice(&c.to_be_bytes());
    f
}

pub fn tcp_header(sport: u16, dport: u16, flags: u8) -> Vec<u8> {
    let mut t = vec![0u8; 20];
    t[0..2].copy_from_slice(&sport.to_be_bytes());
    t[2..4].copy_from_slice(&dport.to_be_bytes());
    t[4..8].copy_from_slice(&1000u32.to_be_bytes());
    t[12] = 5 << 4;
    t[13] = flags;
    t[14..16].copy_from_slice(&64240u16.to_be_bytes());
    t
}

pub fn udp_header(sport: u16, dport: u16, data: &[u8]) -> Vec<u8> {
    let mut u = vec![0u8; 8];
    u[0..2].copy_from_slice(&sport.to_be_bytes());
    u[2..4].copy_from_slice(&dport.to_be_bytes());
    u[4..6].copy_from_slice(&((8 + data.len()) as u16).to_be_bytes());
    u.extend_from_slice(data);
    u
}

pub const TCP_SYN: u8 = 0x02;
pub const TCP_ACK: u8 = 0x10;

pub fn tcp(dst_mac: Mac, src_mac: Mac, vlan: Option<u16>, src: (Ipv4Addr, u16), dst: (Ipv4Addr, u16)) -> Vec<u8> {
    ipv4(dst_mac, src_mac, vlan, Ip4::new(src.0, dst.0, 6), &tcp_header(src.1, dst.1, TCP_SYN))
}

/// A TCP segment with ACK only: a connection's packets after the SYN.
pub fn tcp_ack(dst_mac: Mac, src_mac: Mac, vlan: Option<u16>, src: (Ipv4Addr, u16), dst: (Ipv4Addr, u16)) -> Vec<u8> {
    ipv4(dst_mac, src_mac, vlan, Ip4::new(src.0, dst.0, 6), &tcp_header(src.1, dst.1, TCP_ACK))
}

pub fn udp(dst_mac: Mac, src_mac: Mac, src: (Ipv4Addr, u16), dst: (Ipv4Addr, u16), data: &[u8]) -> Vec<u8> {
    ipv4(dst_mac, src_mac, None, Ip4::new(src.0, dst.0, 17), &udp_header(src.1, dst.1, data))
}

pub fn icmp_echo(dst_mac: Mac, src_mac: Mac, src: Ipv4Addr, dst: Ipv4Addr) -> Vec<u8> {
    let mut m = vec![8u8, 0, 0, 0, 0, 1, 0, 1, b'v', b'i', b'p', 0];
    let c = csum(&m);
    m[2..4].copy_from_slice(&c.to_be_bytes());
    ipv4(dst_mac, src_mac, None, Ip4::new(src, dst, 1), &m)
}

/// An ICMP error (`kind`: type and code) from `src` to `dst` quoting `quoted`
/// (the start of the IP packet it is about); `rest` is the word after the
/// checksum (the next-hop MTU of "fragmentation needed").
pub fn icmp_error(dst_mac: Mac, src_mac: Mac, vlan: Option<u16>, (src, dst): (Ipv4Addr, Ipv4Addr), kind: (u8, u8), rest: u32, quoted: &[u8]) -> Vec<u8> {
    let mut m = vec![kind.0, kind.1, 0, 0];
    m.extend_from_slice(&rest.to_be_bytes());
    m.extend_from_slice(quoted);
    let c = csum(&m);
    m[2..4].copy_from_slice(&c.to_be_bytes());
    ipv4(dst_mac, src_mac, vlan, Ip4::new(src, dst, 1), &m)
}

/// [`icmp_error`] for ICMPv6 (`rest`: the MTU of "packet too big").
pub fn icmp6_error(dst_mac: Mac, src_mac: Mac, vlan: Option<u16>, addrs: (Ipv6Addr, Ipv6Addr), kind: (u8, u8), rest: u32, quoted: &[u8]) -> Vec<u8> {
    let mut m = vec![kind.0, kind.1, 0, 0];
    m.extend_from_slice(&rest.to_be_bytes());
    m.extend_from_slice(quoted);
    ipv6(dst_mac, src_mac, vlan, addrs, 64, 58, &m)
}

/// The IP packet in `frame` (untagged or with one tag).
pub fn l3(frame: &[u8]) -> &[u8] {
    &frame[if frame[12..14] == [0x81, 0x00] { 18 } else { 14 }..]
}

/// An IPv6 packet (`next` header, `payload`) in an Ethernet frame; the checksum
/// of an ICMPv6 payload (at bytes 2..4) is filled in.
pub fn ipv6(dst_mac: Mac, src_mac: Mac, vlan: Option<u16>, (src, dst): (Ipv6Addr, Ipv6Addr), hop_limit: u8, next: u8, payload: &[u8]) -> Vec<u8> {
    let mut f = eth(dst_mac, src_mac, vlan, 0x86dd);
    f.extend_from_slice(&[0x60, 0, 0, 0]);
    f.extend_from_slice(&(payload.len() as u16).to_be_bytes());
    f.extend_from_slice(&[next, hop_limit]);
    f.extend_from_slice(&src.octets());
    f.extend_from_slice(&dst.octets());
    let mut payload = payload.to_vec();
    if next == 58 && payload.len() >= 4 {
        payload[2..4].copy_from_slice(&[0, 0]);
        let mut pseudo = Vec::with_capacity(40 + payload.len() + 1);
        pseudo.extend_from_slice(&src.octets());
        pseudo.extend_from_slice(&dst.octets());
        pseudo.extend_from_slice(&(payload.len() as u32).to_be_bytes());
        pseudo.extend_from_slice(&[0, 0, 0, 58]);
        pseudo.extend_from_slice(&payload);
        let c = csum(&pseudo);
        payload[2..4].copy_from_slice(&c.to_be_bytes());
    }
    f.extend_from_slice(&payload);
    f
}

/// The solicited-node multicast address of `a` (ff02::1:ffXX:XXXX).
pub fn solicited_node(a: Ipv6Addr) -> Ipv6Addr {
    let o = a.octets();
    Ipv6Addr::from([0xff, 0x02, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 0xff, o[13], o[14], o[15]])
}

/// The Ethernet multicast address of an IPv6 group (33:33 and its last 32 bits).
pub fn multicast_mac(group: Ipv6Addr) -> Mac {
    let o = group.octets();
    [0x33, 0x33, o[12], o[13], o[14], o[15]]
}

/// ICMPv6 type of a Neighbor Solicitation and of a Neighbor Advertisement.
pub const ND_NS: u8 = 135;
pub const ND_NA: u8 = 136;
/// Neighbor Advertisement flags.
pub const NA_ROUTER: u8 = 0x80;
pub const NA_SOLICITED: u8 = 0x40;
pub const NA_OVERRIDE: u8 = 0x20;

/// A neighbour discovery message body: type, code, checksum (left 0), the flags
/// byte and 3 reserved, the target, then `options` as given.
pub fn nd_message(icmp_type: u8, code: u8, flags: u8, target: Ipv6Addr, options: &[u8]) -> Vec<u8> {
    let mut m = vec![icmp_type, code, 0, 0, flags, 0, 0, 0];
    m.extend_from_slice(&target.octets());
    m.extend_from_slice(options);
    m
}

/// A link-layer address option (1: source, 2: target).
pub fn ll_option(kind: u8, mac: Mac) -> Vec<u8> {
    let mut o = vec![kind, 1];
    o.extend_from_slice(&mac);
    o
}

/// A well-formed Neighbor Solicitation from (`src_mac`, `src`) for `target`, to
/// its solicited-node group, with a source link-layer address option unless
/// `src` is the unspecified address (duplicate address detection).
pub fn neighbor_solicitation(src_mac: Mac, vlan: Option<u16>, src: Ipv6Addr, target: Ipv6Addr) -> Vec<u8> {
    let group = solicited_node(target);
    let opts = if src.is_unspecified() { Vec::new() } else { ll_option(1, src_mac) };
    ipv6(multicast_mac(group), src_mac, vlan, (src, group), 255, 58, &nd_message(ND_NS, 0, 0, target, &opts))
}

/// A Neighbor Advertisement for `target` at `tlla` (option left out when None).
pub fn neighbor_advertisement(
    dst_mac: Mac,
    src_mac: Mac,
    vlan: Option<u16>,
    (src, dst): (Ipv6Addr, Ipv6Addr),
    flags: u8,
    target: Ipv6Addr,
    tlla: Option<Mac>,
) -> Vec<u8> {
    let opts = tlla.map(|m| ll_option(2, m)).unwrap_or_default();
    ipv6(dst_mac, src_mac, vlan, (src, dst), 255, 58, &nd_message(ND_NA, 0, flags, target, &opts))
}

/// The advertisement RFC 4861 7.2.4 owes to the solicitation `ns` (untagged or
/// one tag, kept) from `our_mac`: Solicited and Override set, to the soliciting
/// node, or Override alone to all-nodes when it came from the unspecified
/// address; our MAC as the target link-layer address.
pub fn neighbor_advertisement_for(ns: &[u8], our_mac: Mac) -> Vec<u8> {
    let tagged = ns[12..14] == [0x81, 0x00];
    let (off, vlan) = if tagged { (18, Some(u16::from_be_bytes([ns[14], ns[15]]) & 0xfff)) } else { (14, None) };
    let ip = &ns[off..];
    let src = Ipv6Addr::from(<[u8; 16]>::try_from(&ip[8..24]).unwrap());
    let target = Ipv6Addr::from(<[u8; 16]>::try_from(&ip[48..64]).unwrap());
    let (dst_mac, dst, flags) = if src.is_unspecified() {
        ([0x33, 0x33, 0, 0, 0, 1], Ipv6Addr::new(0xff02, 0, 0, 0, 0, 0, 0, 1), NA_OVERRIDE)
    } else {
        (ns[6..12].try_into().unwrap(), src, NA_SOLICITED | NA_OVERRIDE)
    };
    let mut na = neighbor_advertisement(dst_mac, our_mac, vlan, (target, dst), flags, target, Some(our_mac));
    if tagged {
        na[14..16].copy_from_slice(&ns[14..16]); // the whole tag (priority bits too)
    }
    na
}

/// A TCP segment (SYN, or `flags`) over IPv6.
pub fn tcp6(dst_mac: Mac, src_mac: Mac, vlan: Option<u16>, src: (Ipv6Addr, u16), dst: (Ipv6Addr, u16), flags: u8) -> Vec<u8> {
    ipv6(dst_mac, src_mac, vlan, (src.0, dst.0), 64, 6, &tcp_header(src.1, dst.1, flags))
}

/// A UDP datagram over IPv6.
pub fn udp6(dst_mac: Mac, src_mac: Mac, src: (Ipv6Addr, u16), dst: (Ipv6Addr, u16), data: &[u8]) -> Vec<u8> {
    ipv6(dst_mac, src_mac, None, (src.0, dst.0), 64, 17, &udp_header(src.1, dst.1, data))
}

/// IPv6 extension header types.
pub const EXT_HOP_BY_HOP: u8 = 0;
pub const EXT_ROUTING: u8 = 43;
pub const EXT_FRAGMENT: u8 = 44;
pub const EXT_AH: u8 = 51;
pub const EXT_DEST_OPTS: u8 = 60;

/// One extension header of type `kind` whose next header is `next`: a fragment
/// header (`frag`: offset in 8-byte units and more-fragments), an AH of 12 bytes,
/// or an options/routing header of `units` + 1 8-byte units padded with PadN.
pub fn ext_header(kind: u8, next: u8, units: u8, frag: (u16, bool)) -> Vec<u8> {
    match kind {
        EXT_FRAGMENT => {
            let off = frag.0 << 3 | u16::from(frag.1);
            let mut h = vec![next, 0];
            h.extend_from_slice(&off.to_be_bytes());
            h.extend_from_slice(&0x1234_5678u32.to_be_bytes());
            h
        }
        EXT_AH => {
            let mut h = vec![next, 1, 0, 0];
            h.extend_from_slice(&[0; 8]);
            h
        }
        _ => {
            let len = (usize::from(units) + 1) * 8;
            let mut h = vec![next, units, 1, (len - 4) as u8];
            h.resize(len, 0);
            h
        }
    }
}

/// An IPv6 packet whose extension headers are `exts` (type, 8-byte units beyond
/// the first, fragment offset and flag) then `upper` carrying `payload`.
pub fn ipv6_ext(
    dst_mac: Mac,
    src_mac: Mac,
    vlan: Option<u16>,
    addrs: (Ipv6Addr, Ipv6Addr),
    exts: &[(u8, u8, (u16, bool))],
    upper: u8,
    payload: &[u8],
) -> Vec<u8> {
    let mut body = Vec::new();
    for (i, &(kind, units, frag)) in exts.iter().enumerate() {
        let next = exts.get(i + 1).map_or(upper, |e| e.0);
        body.extend_from_slice(&ext_header(kind, next, units, frag));
    }
    body.extend_from_slice(payload);
    ipv6(dst_mac, src_mac, vlan, addrs, 64, exts.first().map_or(upper, |e| e.0), &body)
}
