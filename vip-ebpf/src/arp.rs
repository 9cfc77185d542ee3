//! ARP: answer requests for VIPs this node holds on the receiving interface.
use core::ptr::{read_unaligned, write_unaligned};

use aya_ebpf::{bindings::xdp_action, helpers::bpf_ktime_get_coarse_ns, programs::XdpContext};
use network_types::{arp::ArpHdr, eth::EthHdr};
use vip_common::{HeldKey, HeldVip, Reason, HELD_NO_ARP};

use crate::{
    maps::arp_held,
    parse::{ptr_at, Verdict},
};

const ARPHRD_ETHER: u16 = 1;
const ETH_P_IP: u16 = 0x0800;
const ARPOP_REQUEST: u16 = 1;
const ARPOP_REPLY: u16 = 2;

/// This node's entry for `vip` on `ifindex`: our MAC there, and whether it is
/// fresh. An entry whose deadline has passed means the agent stopped vouching for
/// it (fencing, or released after the VIP moved): not answered, not balanced for
/// new flows. The coarse clock costs a few ns where `bpf_ktime_get_ns` costs ~25
/// (a third of a flow-table hit); it lags by up to a tick, which the agent covers
/// by storing deadlines two ticks early.
#[inline(always)]
pub fn arp_held_entry(ifindex: u32, vip: [u8; 4]) -> Option<([u8; 6], bool)> {
    let h = arp_held_get(ifindex, vip)?;
    Some((h.mac, held_fresh(h)))
}

#[inline(always)]
fn arp_held_get(ifindex: u32, vip: [u8; 4]) -> Option<&'static HeldVip> {
    unsafe { arp_held.get(&HeldKey { ifindex, vip }) }
}

#[inline(always)]
fn held_fresh(h: &HeldVip) -> bool {
    (unsafe { bpf_ktime_get_coarse_ns() }) <= h.deadline_ns
}

/// Our MAC if this node holds `vip` on `ifindex` now (fresh) and announces it by
/// ARP, else why not.
#[inline(always)]
pub fn arp_held_fresh(ifindex: u32, vip: [u8; 4]) -> Result<[u8; 6], Reason> {
    let h = arp_held_get(ifindex, vip).ok_or(Reason::ArpNotHeld)?;
    if h.flags & HELD_NO_ARP != 0 {
        return Err(Reason::ArpNotAnnounced);
    }
    if !held_fresh(h) {
        return Err(Reason::ArpStale);
    }
    Ok(h.mac)
}

/// Rewrites an ARP request for a held VIP into the RFC 826 reply, in place, and
/// sends it back out. Everything else (replies, gratuitous ARP, other targets,
/// non-Ethernet/IPv4 ARP) passes untouched; a reply or gratuitous ARP in which
/// another MAC claims a VIP we hold here is counted as `arp_conflict`.
#[inline(always)]
pub fn arp_handle<const L2: usize>(ctx: &XdpContext, ifindex: u32) -> Result<Verdict, ()> {
    let arp: *mut ArpHdr = ptr_at(ctx, L2)?;
    let a = unsafe { &mut *arp };
    if u16::from_be_bytes(a.htype) != ARPHRD_ETHER || u16::from_be_bytes(a.ptype) != ETH_P_IP || a.hlen != 6 || a.plen != 4 {
        return Ok((xdp_action::XDP_PASS, Reason::ArpOther));
    }
    let oper = u16::from_be_bytes(a.oper);
    if oper == ARPOP_REPLY || (oper == ARPOP_REQUEST && a.spa == a.tpa) {
        // Someone announces spa is at sha. If spa is a VIP we hold (fresh) on this
        // interface and sha is not our MAC, two nodes claim the VIP: count it, and
        // let the stack see the frame as it is.
        return Ok(match arp_held_fresh(ifindex, a.spa) {
            Ok(mac) if a.sha != mac => (xdp_action::XDP_PASS, Reason::ArpConflict),
            _ => (xdp_action::XDP_PASS, Reason::ArpOther),
        });
    }
    if oper != ARPOP_REQUEST {
        return Ok((xdp_action::XDP_PASS, Reason::ArpOther));
    }
    let vip = a.tpa;
    let mac = match arp_held_fresh(ifindex, vip) {
        Ok(mac) => mac,
        // Announced from lo by a routing daemon: our kernel would answer for an
        // address on lo (arp_ignore=0), drawing the VIP's traffic over L2; nobody must.
        Err(Reason::ArpNotAnnounced) => return Ok((xdp_action::XDP_DROP, Reason::ArpNotAnnounced)),
        Err(reason) => return Ok((xdp_action::XDP_PASS, reason)),
    };
    let eth: *mut EthHdr = ptr_at(ctx, 0)?;
    let eth = unsafe { &mut *eth };
    // Copies within the packet go through locals, as words: a 6-byte copy between
    // two packet pointers compiles to memmove, whose pointer comparison the
    // verifier refuses without CAP_PERFMON.
    let (sha_lo, sha_hi, spa) = unsafe {
        (read_unaligned(a.sha.as_ptr() as *const u32), read_unaligned(a.sha.as_ptr().add(4) as *const u16), read_unaligned(a.spa.as_ptr() as *const u32))
    };
    unsafe {
        // RFC 826: the reply goes to the sender hardware address (as Linux does).
        write_unaligned(eth.dst_addr.as_mut_ptr() as *mut u32, sha_lo);
        write_unaligned(eth.dst_addr.as_mut_ptr().add(4) as *mut u16, sha_hi);
        write_unaligned(a.tha.as_mut_ptr() as *mut u32, sha_lo);
        write_unaligned(a.tha.as_mut_ptr().add(4) as *mut u16, sha_hi);
        write_unaligned(a.tpa.as_mut_ptr() as *mut u32, spa);
    }
    eth.src_addr = mac;
    a.oper = ARPOP_REPLY.to_be_bytes();
    a.sha = mac;
    a.spa = vip;
    Ok((xdp_action::XDP_TX, Reason::ArpAnswered))
}
