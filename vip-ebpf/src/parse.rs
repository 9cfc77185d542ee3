//! Bounds-checked header access and the Ethernet / 802.1Q layer.
use core::mem;

use aya_ebpf::programs::XdpContext;
use network_types::{eth::EthHdr, vlan::VlanHdr};
use vip_common::Reason;

/// What the program returns, and the counter that says why.
pub type Verdict = (u32, Reason);

const ETH_P_IP: u16 = 0x0800;
const ETH_P_ARP: u16 = 0x0806;
const ETH_P_8021Q: u16 = 0x8100;
const ETH_P_8021AD: u16 = 0x88A8;

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

/// The layer-3 protocol and the offset of its header.
pub enum L3 {
    Arp(usize),
    Ipv4(usize),
    Other,
}

/// Parses Ethernet and at most one VLAN tag. A frame shorter than an Ethernet
/// header is malformed; a second tag (QinQ) is not ours and passes.
#[inline(always)]
pub fn l3(ctx: &XdpContext) -> Result<L3, ()> {
    let eth: *const EthHdr = ptr_at(ctx, 0)?;
    let mut ether_type = u16::from_be(unsafe { (*eth).ether_type });
    let mut off = EthHdr::LEN;
    if ether_type == ETH_P_8021Q || ether_type == ETH_P_8021AD {
        let vlan: *const VlanHdr = ptr_at(ctx, off)?;
        ether_type = u16::from_be(unsafe { (*vlan).ether_type });
        off += VlanHdr::LEN;
    }
    Ok(match ether_type {
        ETH_P_ARP => L3::Arp(off),
        ETH_P_IP => L3::Ipv4(off),
        _ => L3::Other,
    })
}
