//! Protocol numbers and header constants the parsers share (arp.rs, ndp.rs,
//! lb4.rs, lb6.rs, parse.rs), declared once. `ETH_P_ARP`, `PROTO_TCP` and
//! `PROTO_UDP` are in vip-common: the agent uses them too.
use network_types::ip::Ipv6Hdr;

/// EtherTypes: IPv4, IPv6, and the 802.1Q and 802.1ad tags.
pub const ETH_P_IP: u16 = 0x0800;
pub const ETH_P_IPV6: u16 = 0x86DD;
pub const ETH_P_8021Q: u16 = 0x8100;
pub const ETH_P_8021AD: u16 = 0x88A8;

/// IP protocols, and the IPv6 extension headers walked (lb6.rs).
pub const IPPROTO_HOPOPTS: u8 = 0;
pub const IPPROTO_ICMP: u8 = 1;
pub const IPPROTO_ROUTING: u8 = 43;
pub const IPPROTO_FRAGMENT: u8 = 44;
pub const IPPROTO_ICMPV6: u8 = 58;
pub const IPPROTO_DSTOPTS: u8 = 60;

/// More-fragments flag and fragment offset, in IPv4's host-order `frags` word.
pub const IP_MF_OFFSET: u16 = 0x3fff;
pub const IP_OFFSET: u16 = 0x1fff;
/// The IPv6 header's length.
pub const IP6: usize = Ipv6Hdr::LEN;

/// ICMP's destination unreachable (every code: fragmentation needed is 4), and
/// the header before the quoted packet.
pub const ICMP_DEST_UNREACH: u8 = 3;
pub const ICMP_HDR_LEN: usize = 8;
/// ICMPv6 errors about a flow (RFC 4443), and the header before the quoted packet.
pub const ICMP6_DST_UNREACH: u8 = 1;
pub const ICMP6_PACKET_TOO_BIG: u8 = 2;
pub const ICMP6_HDR_LEN: usize = 8;
/// Neighbour discovery's ICMPv6 types (RFC 4861, 4.1 to 4.5; ndp.rs).
pub const ND_ROUTER_SOLICIT: u8 = 133;
pub const ND_NEIGHBOR_SOLICIT: u8 = 135;
pub const ND_NEIGHBOR_ADVERT: u8 = 136;
pub const ND_REDIRECT: u8 = 137;

/// The flags byte's offset in the TCP header, and the flags that tell a SYN.
pub const TCP_FLAGS: usize = 13;
pub const TCP_SYN: u8 = 0x02;
pub const TCP_ACK: u8 = 0x10;
