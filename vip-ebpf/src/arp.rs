//! ARP: answer requests for VIPs this node holds on the receiving interface.
use core::ptr::{read_unaligned, write_unaligned};

use aya_ebpf::{
    bindings::{xdp_action, xdp_md},
    helpers::bpf_ktime_get_coarse_ns,
    programs::XdpContext,
};
use network_types::arp::ArpHdr;
use vip_common::{ArpHeldKey, ArpWatch, HeldVip, Reason, ARP_WATCH_MACS, HELD_NO_ARP};

use crate::{
    maps::{arp_conflicts, arp_held, arp_watch, held4_slot, lookup_at, Scratch},
    parse::{frame_len, ptr_at, verdict_pack, Verdict},
    proto::ETH_P_IP,
};

const ARPHRD_ETHER: u16 = 1;
const ARPOP_REQUEST: u16 = 1;
const ARPOP_REPLY: u16 = 2;

/// The held entry for (`ifindex`, `vip`): its copy in `lb4_held_slots`, else
/// `arp_held`'s, its key built in this CPU's scratch `s` rather than on the stack
/// (see maps::LB_KEY0; `arp_watch_record` reads it there too).
#[inline(always)]
fn arp_held_get(s: *mut Scratch, ifindex: u32, vip: [u8; 4]) -> Option<*const HeldVip> {
    unsafe {
        (*s).held = ArpHeldKey { ifindex, vip };
        if let Some(h) = held4_slot(s) {
            return Some(h);
        }
        lookup_at::<_, HeldVip>(&arp_held, (&raw const (*s).held).cast()).map(|h| h as *const HeldVip)
    }
}

/// This node's entry for `vip` on `ifindex` if it holds it now (fresh) and
/// announces it by ARP, else why not. The clock is read before the lookup, so that
/// no pointer has to live on the stack across a helper call (a speculation barrier
/// each without CAP_PERFMON, see maps::LB_KEY0).
#[inline(always)]
fn arp_held_fresh(s: *mut Scratch, ifindex: u32, vip: [u8; 4]) -> Result<*const HeldVip, Reason> {
    let now = unsafe { bpf_ktime_get_coarse_ns() };
    held_fresh(now, arp_held_get(s, ifindex, vip), [Reason::ArpNotHeld, Reason::ArpNotAnnounced, Reason::ArpStale])
}

/// The held entry `h` (of `arp_held` or `ndp_held`) if it is announced and fresh
/// at `now`, else the reason of `why` that says why not: not held, not announced
/// (`announce: lo`), stale.
#[inline(always)]
pub fn held_fresh(now: u64, h: Option<*const HeldVip>, why: [Reason; 3]) -> Result<*const HeldVip, Reason> {
    let h = h.ok_or(why[0])?;
    if unsafe { (*h).flags } & HELD_NO_ARP != 0 {
        return Err(why[1]);
    }
    if now > unsafe { (*h).deadline_ns } {
        return Err(why[2]);
    }
    Ok(h)
}

/// Counts a conflict on (`ifindex`, `vip`) in `arp_conflicts`. Not atomic: two
/// CPUs counting at once may count one; the agent only looks for an increase.
#[inline(always)]
fn arp_conflict_record(ifindex: u32, vip: [u8; 4]) {
    let key = ArpHeldKey { ifindex, vip };
    match arp_conflicts.get_ptr_mut(&key) {
        Some(c) => unsafe { *c = (*c).wrapping_add(1) },
        None => {
            let _ = arp_conflicts.insert(&key, &1, 0);
        }
    }
}

/// Records the sender MAC of an ARP reply or gratuitous ARP, copied into the
/// scratch `s` (`mac`), in the `arp_watch` entry of the key `arp_held_get` left
/// there, if the agent watches that VIP on that network; the reason to count.
/// Only claims for VIPs this node does not hold come here. A function of its own
/// (BPF to BPF) taking the scratch alone: with the packet pointer too, or inlined,
/// the compiler kept more values across `arp_handle`'s helper calls and the
/// answering path got slower.
#[inline(never)]
fn arp_watch_record(s: *mut Scratch) -> Reason {
    let now = unsafe { bpf_ktime_get_coarse_ns() };
    let Some(w) = lookup_at::<_, ArpWatch>(&arp_watch, unsafe { (&raw const (*s).held).cast() }) else {
        return Reason::ArpOther;
    };
    unsafe {
        let w = &mut *w;
        let sha = (&raw const (*s).mac) as *const u8;
        let lo = read_unaligned(sha as *const u32);
        let hi = read_unaligned(sha.add(4) as *const u16);
        w.replies = w.replies.wrapping_add(1);
        w.last_ns = now;
        // Constant indices: `seen` comes from a map the agent writes.
        for i in 0..ARP_WATCH_MACS {
            let m = (&raw mut w.macs[i]) as *mut u8;
            if w.seen == i as u32 {
                write_unaligned(m as *mut u32, lo);
                write_unaligned(m.add(4) as *mut u16, hi);
                w.seen += 1;
                break;
            }
            if read_unaligned(m as *const u32) == lo && read_unaligned(m.add(4) as *const u16) == hi {
                break;
            }
        }
    }
    Reason::ArpWatched
}

/// [`arp_handle`] as a function of its own (BPF to BPF), its verdict packed
/// ([`verdict_pack`]): inlined, its live values made the compiler spill registers
/// on the IPv4 paths too (speculation barriers without CAP_PERFMON, maps::LB_KEY0).
#[inline(never)]
pub fn arp_call<const L2: usize>(ctx: *mut xdp_md, s: *mut Scratch, ifindex: u32) -> u64 {
    match arp_handle::<L2>(&XdpContext::new(ctx), s, ifindex) {
        Ok(v) => verdict_pack(v),
        Err(()) => {
            unsafe { (*s).bytes = frame_len(&XdpContext::new(ctx)) as u32 };
            verdict_pack((xdp_action::XDP_DROP, Reason::DropMalformed))
        }
    }
}

/// Rewrites an ARP request for a held VIP into the RFC 826 reply, in place, and
/// sends it back out. Everything else (replies, gratuitous ARP, other targets,
/// non-Ethernet/IPv4 ARP) passes untouched; a reply or gratuitous ARP in which
/// another MAC claims a VIP we hold here is counted as `arp_conflict`.
#[inline(always)]
fn arp_handle<const L2: usize>(ctx: &XdpContext, s: *mut Scratch, ifindex: u32) -> Result<Verdict, ()> {
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
        // sha into the scratch: after the lookups it is read from there, and
        // the packet pointer need not be kept (see arp_watch_record).
        unsafe {
            let m = (&raw mut (*s).mac) as *mut u8;
            write_unaligned(m as *mut u32, read_unaligned((arp as *const u8).add(8) as *const u32));
            write_unaligned(m.add(4) as *mut u16, read_unaligned((arp as *const u8).add(12) as *const u16));
        }
        return Ok(match arp_held_fresh(s, ifindex, a.spa) {
            Ok(h) if unsafe { (*s).mac != (*h).mac } => {
                arp_conflict_record(ifindex, a.spa);
                (xdp_action::XDP_PASS, Reason::ArpConflict)
            }
            Ok(_) => (xdp_action::XDP_PASS, Reason::ArpOther),
            // Not ours: the agent may be checking who answers for it (arp_watch).
            Err(_) => (xdp_action::XDP_PASS, arp_watch_record(s)),
        });
    }
    if oper != ARPOP_REQUEST {
        return Ok((xdp_action::XDP_PASS, Reason::ArpOther));
    }
    let h = match arp_held_fresh(s, ifindex, a.tpa) {
        Ok(h) => h,
        // Announced from lo by a routing daemon: our kernel would answer for an
        // address on lo (arp_ignore=0), drawing the VIP's traffic over L2; nobody must.
        Err(Reason::ArpNotAnnounced) => return Ok((xdp_action::XDP_DROP, Reason::ArpNotAnnounced)),
        Err(reason) => return Ok((xdp_action::XDP_PASS, reason)),
    };
    // The Ethernet header from the ARP pointer, not from ctx: ctx would have to
    // live on the stack across the lookup. Each copy is one word read and written
    // at once (a 6-byte copy between packet pointers compiles to memmove, which the
    // verifier refuses without CAP_PERFMON; values held longer would be spilled).
    unsafe {
        let p = arp as *mut u8;
        let eth = p.sub(L2);
        let mac = (&raw const (*h).mac) as *const u8;
        // RFC 826: the reply goes to the sender hardware address (as Linux does).
        let sha_lo = read_unaligned(p.add(8) as *const u32);
        write_unaligned(eth as *mut u32, sha_lo);
        write_unaligned(p.add(18) as *mut u32, sha_lo);
        let sha_hi = read_unaligned(p.add(12) as *const u16);
        write_unaligned(eth.add(4) as *mut u16, sha_hi);
        write_unaligned(p.add(22) as *mut u16, sha_hi);
        // spa and tpa swap places (tpa is the VIP).
        let spa = read_unaligned(p.add(14) as *const u32);
        let tpa = read_unaligned(p.add(24) as *const u32);
        write_unaligned(p.add(24) as *mut u32, spa);
        write_unaligned(p.add(14) as *mut u32, tpa);
        // Our MAC: source of the frame and sender hardware address.
        let mac_lo = read_unaligned(mac as *const u32);
        write_unaligned(eth.add(6) as *mut u32, mac_lo);
        write_unaligned(p.add(8) as *mut u32, mac_lo);
        let mac_hi = read_unaligned(mac.add(4) as *const u16);
        write_unaligned(eth.add(10) as *mut u16, mac_hi);
        write_unaligned(p.add(12) as *mut u16, mac_hi);
        write_unaligned(p.add(6) as *mut u16, ARPOP_REPLY.to_be());
    }
    Ok((xdp_action::XDP_TX, Reason::ArpAnswered))
}
