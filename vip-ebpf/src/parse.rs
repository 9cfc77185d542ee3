//! Bounds-checked header access and the Ethernet / 802.1Q layer.
use core::mem;

use aya_ebpf::{bindings::xdp_action, helpers::bpf_xdp_get_buff_len, programs::XdpContext};
use network_types::{eth::EthHdr, vlan::VlanHdr};
use vip_common::{Reason, ETH_P_ARP, ETH_P_ASK4, ETH_P_ASK6};

use crate::{
    maps::Scratch,
    proto::{ETH_P_8021AD, ETH_P_8021Q, ETH_P_IP, ETH_P_IPV6},
};

/// What the program returns, and the counter that says why.
pub type Verdict = (u32, Reason);

/// A verdict in one register, as a function of the program's own returns it
/// (a pair would be returned through the stack).
#[inline(always)]
pub fn verdict_pack((action, reason): Verdict) -> u64 {
    u64::from(action) << 32 | reason as u64
}

/// A function's result packed ([`verdict_pack`]): a header cut short drops the
/// frame as malformed, counted by its whole length.
#[inline(always)]
pub fn verdict_pack_or_malformed(ctx: &XdpContext, s: *mut Scratch, r: Result<Verdict, ()>) -> u64 {
    verdict_pack(match r {
        Ok(v) => v,
        Err(()) => {
            unsafe { (*s).bytes = frame_len(ctx) as u32 };
            (xdp_action::XDP_DROP, Reason::DropMalformed)
        }
    })
}

/// The body of a function the program calls (BPF to BPF) rather than inlines:
/// the path `$f` on the frame at `$ctx`, its verdict packed
/// ([`verdict_pack_or_malformed`]). A macro: the same body through a closure or
/// a function pointer compiles to a verdict in two registers, packed at the end.
macro_rules! verdict_call {
    ($ctx:ident, $s:ident, $f:expr) => {{
        let ctx = aya_ebpf::programs::XdpContext::new($ctx);
        $crate::parse::verdict_pack_or_malformed(&ctx, $s, $f(&ctx, $s))
    }};
}
pub(crate) use verdict_call;

#[inline(always)]
pub fn verdict_unpack(v: u64) -> Verdict {
    // Made by verdict_pack from a Reason.
    ((v >> 32) as u32, unsafe { core::mem::transmute::<u32, Reason>(v as u32) })
}

/// A pointer to a `T` at `offset` in the packet, or `Err` if the packet is too short.
#[inline(always)]
pub fn ptr_at<T>(ctx: &XdpContext, offset: usize) -> Result<*mut T, ()> {
    let start = ctx.data();
    let end = ctx.data_end();
    if start + offset + mem::size_of::<T>() > end {
        return Err(());
    }
    Ok((start + offset) as *mut T)
}

/// Layer-2 header lengths: Ethernet, and Ethernet with one 802.1Q/802.1ad tag.
/// The handlers take theirs as a const generic, so that every packet offset is a
/// constant: the verifier accepts a variable offset added to a packet pointer only
/// from a loader with CAP_PERFMON (its Spectre v1 rules), and the agent runs with
/// CAP_BPF and CAP_NET_ADMIN alone. Each handler is compiled twice.
pub const ETH_LEN: usize = EthHdr::LEN;
pub const VLAN_ETH_LEN: usize = EthHdr::LEN + VlanHdr::LEN;

/// The frame's length, for the paths whose headers do not give one (a helper call:
/// `data_end - data` is pointer arithmetic, refused without CAP_PERFMON).
#[inline(always)]
pub fn frame_len(ctx: &XdpContext) -> usize {
    (unsafe { bpf_xdp_get_buff_len(ctx.ctx) }) as usize
}

/// The layer-3 protocol (its header is at ETH_LEN, or VLAN_ETH_LEN when tagged).
pub enum L3 {
    Arp,
    Ipv4,
    Ipv6,
    Other,
}

/// The frame's VLAN tagging.
pub enum Vlan {
    Untagged,
    /// One 802.1Q tag with this VLAN id (0: priority-tagged, which Linux
    /// delivers to the untagged network).
    Id(u16),
    /// An 802.1ad (S-tag) outer tag or two tags (QinQ): no pool lives there.
    Foreign,
}

/// Parses Ethernet and its VLAN tags: the layer-3 protocol behind at most one
/// 802.1Q tag, and the tagging. A frame shorter than its headers is malformed.
/// The tags are read from the frame, so they must reach XDP inside it: the agent
/// turns off receive VLAN stripping on the interfaces it attaches to (a stripped
/// tag would make a VLAN's frames look untagged).
#[inline(always)]
///
/// An untagged frame of `ETH_P_ASK4` or `ETH_P_ASK6` (another node asks about a
/// flow, lb::lb_ask) gets IPv4's or IPv6's EtherType back and is said to be
/// asked (the last of the three).
pub fn l3(ctx: &XdpContext) -> Result<(L3, Vlan, bool), ()> {
    let eth: *mut EthHdr = ptr_at(ctx, 0)?;
    let mut ether_type = u16::from_be(unsafe { (*eth).ether_type });
    let mut vlan = Vlan::Untagged;
    if ether_type == ETH_P_8021Q || ether_type == ETH_P_8021AD {
        let tag: *const VlanHdr = ptr_at(ctx, ETH_LEN)?;
        let outer = ether_type;
        ether_type = u16::from_be(unsafe { (*tag).ether_type });
        vlan = if outer == ETH_P_8021AD || ether_type == ETH_P_8021Q || ether_type == ETH_P_8021AD {
            Vlan::Foreign
        } else {
            Vlan::Id(u16::from_be_bytes(unsafe { (*tag).tci }) & 0x0fff)
        };
    }
    let l3 = match ether_type {
        ETH_P_ARP => L3::Arp,
        ETH_P_IP => L3::Ipv4,
        ETH_P_IPV6 => L3::Ipv6,
        ETH_P_ASK4 | ETH_P_ASK6 if matches!(vlan, Vlan::Untagged) => {
            let (l3, restored) = if ether_type == ETH_P_ASK4 { (L3::Ipv4, ETH_P_IP) } else { (L3::Ipv6, ETH_P_IPV6) };
            unsafe { (*eth).ether_type = restored.to_be() };
            return Ok((l3, vlan, true));
        }
        _ => L3::Other,
    };
    Ok((l3, vlan, false))
}
