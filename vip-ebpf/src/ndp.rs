//! NDP: answer IPv6 Neighbor Solicitations (RFC 4861) for VIPs this node holds
//! on the receiving interface, the IPv6 twin of arp.rs. Other IPv6 passes.
use core::{
    ffi::c_void,
    ptr::{read_unaligned, write_unaligned},
};

use aya_ebpf::{
    bindings::{xdp_action, xdp_md},
    helpers::{bpf_ktime_get_coarse_ns, bpf_xdp_adjust_tail, bpf_xdp_load_bytes},
    programs::XdpContext,
};
use network_types::ip::Ipv6Hdr;
use vip_common::{ArpHeldVip, NdpHeldKey, Reason};

use crate::{
    arp::held_fresh,
    maps::{lookup_at, ndp_conflicts, ndp_held, Scratch},
    parse::{frame_len, ptr_at, verdict_pack},
};

pub const IPPROTO_ICMPV6: u8 = 58;
const ND_ROUTER_SOLICIT: u8 = 133;
const ND_NEIGHBOR_SOLICIT: u8 = 135;
const ND_NEIGHBOR_ADVERT: u8 = 136;
const ND_REDIRECT: u8 = 137;
const ND_OPT_SOURCE_LL_ADDR: u8 = 1;
const ND_OPT_TARGET_LL_ADDR: u8 = 2;
/// Type, code, checksum, flags/reserved, target: Neighbor Solicitation and
/// Advertisement alike, options after.
const ND_LEN: usize = 24;
/// The advertisement sent: ND_LEN and one target link-layer address option.
const NA_LEN: usize = ND_LEN + 8;
const NA_FLAG_SOLICITED: u8 = 0x40;
const NA_FLAG_OVERRIDE: u8 = 0x20;
/// Options walked at most (a solicitation carries one or two: source
/// link-layer address, nonce); more is taken as malformed.
const ND_MAX_OPTIONS: usize = 8;
const IP6: usize = Ipv6Hdr::LEN;

/// What the options of a message say, once they are well formed.
struct NdOptions {
    slla: bool,
    /// The target link-layer address option's MAC, if any.
    tlla: Option<[u8; 6]>,
}

/// Walks the `len` bytes of options after an `L2`-byte layer-2 header, the IPv6
/// header and ND_LEN: each is 8 bytes long (its length field 1) and none runs
/// past the end. Each goes into the checksum sum in the scratch (see
/// [`csum_add`]). The options neighbour discovery uses are 8 bytes (link-layer
/// addresses, nonce); a longer one (SEcure Neighbor Discovery's) makes the
/// message malformed here: walking its further bytes too made the verifier's
/// search outgrow its limit. Read with a helper: their offsets vary, and a
/// variable offset added to a packet pointer needs CAP_PERFMON (see
/// parse::ETH_LEN).
#[inline(always)]
fn nd_options<const L2: usize>(ctx: &XdpContext, len: usize, s: *mut Scratch) -> Option<NdOptions> {
    let mut o = NdOptions { slla: false, tlla: None };
    let mut off = 0usize;
    let mut opt = [0u8; 8];
    for _ in 0..ND_MAX_OPTIONS {
        if off == len {
            return Some(o);
        }
        if off + 8 > len {
            return None;
        }
        let at = (L2 + IP6 + ND_LEN + off) as u32;
        if unsafe { bpf_xdp_load_bytes(ctx.ctx, at, opt.as_mut_ptr() as *mut c_void, 8) } != 0 {
            return None; // the frame ends before the payload length says
        }
        if opt[1] != 1 {
            return None;
        }
        unsafe { (*s).csum = csum_add((*s).csum, u64::from_ne_bytes(opt)) };
        match opt[0] {
            ND_OPT_SOURCE_LL_ADDR => o.slla = true,
            ND_OPT_TARGET_LL_ADDR => o.tlla = Some([opt[2], opt[3], opt[4], opt[5], opt[6], opt[7]]),
            _ => {}
        }
        off += 8;
    }
    (off == len).then_some(o)
}

/// Adds the 8 bytes of `w` (as loaded from the packet) to a one's-complement sum
/// kept in 64 bits, as two 32-bit halves: a sum of 16-bit words once folded
/// ([`csum_fold`]), in the packet's byte order whatever the machine's (RFC 1071).
#[inline(always)]
fn csum_add(sum: u64, w: u64) -> u64 {
    sum + (w & 0xffff_ffff) + (w >> 32)
}

/// The pseudo-header's last 8 bytes, the ICMPv6 length `len` and next header, as
/// a start for [`csum_add`].
#[inline(always)]
fn csum_start(len: u32) -> u64 {
    u64::from(u32::from_ne_bytes(len.to_be_bytes())) + u64::from(u32::from_ne_bytes([0, 0, 0, IPPROTO_ICMPV6]))
}

/// The 16-bit one's-complement sum of `sum` (see [`csum_add`]).
#[inline(always)]
fn csum_fold(sum: u64) -> u16 {
    let mut s = (sum & 0xffff_ffff) + (sum >> 32);
    s = (s & 0xffff) + (s >> 16);
    s = (s & 0xffff) + (s >> 16);
    s = (s & 0xffff) + (s >> 16);
    s as u16
}

/// The `ndp_held` entry for (`ifindex`, the 16 bytes at `vip`), its key built in
/// this CPU's scratch (see maps::LB_KEY0).
#[inline(always)]
fn ndp_held_get(s: *mut Scratch, ifindex: u32, vip: *const u8) -> Option<*const ArpHeldVip> {
    unsafe {
        (*s).held6.ifindex = ifindex;
        let k = (&raw mut (*s).held6.vip) as *mut u8;
        write_unaligned(k as *mut u64, read_unaligned(vip as *const u64));
        write_unaligned(k.add(8) as *mut u64, read_unaligned(vip.add(8) as *const u64));
        lookup_at::<_, ArpHeldVip>(&ndp_held, (&raw const (*s).held6).cast()).map(|h| h as *const ArpHeldVip)
    }
}

/// As arp::arp_held_fresh: this node's entry for the VIP at `vip` on `ifindex`
/// if it holds it now (fresh) and announces it, else why not.
#[inline(always)]
fn ndp_held_fresh(s: *mut Scratch, ifindex: u32, vip: *const u8) -> Result<*const ArpHeldVip, Reason> {
    let now = unsafe { bpf_ktime_get_coarse_ns() };
    held_fresh(now, ndp_held_get(s, ifindex, vip), [Reason::NdpNotHeld, Reason::NdpNotAnnounced, Reason::NdpStale])
}

/// Counts a conflict in `ndp_conflicts` (as arp::arp_conflict_record) on the key
/// the last `ndp_held_get` left in this CPU's scratch: the unaligned 16-byte
/// address cannot be copied into a key on the stack, where the verifier wants
/// every access aligned.
#[inline(always)]
fn ndp_conflict_record(s: *mut Scratch) {
    let key: &NdpHeldKey = unsafe { &(*s).held6 };
    match ndp_conflicts.get_ptr_mut(key) {
        Some(c) => unsafe { *c = (*c).wrapping_add(1) },
        None => {
            let _ = ndp_conflicts.insert(key, &1, 0);
        }
    }
}

/// The 16 bytes at `p` as two words.
#[inline(always)]
fn addr_words(p: *const u8) -> (u64, u64) {
    unsafe { (read_unaligned(p as *const u64), read_unaligned(p.add(8) as *const u64)) }
}

/// Whether the 16 bytes at `dst` are the solicited-node multicast address of the
/// target at `target` (ff02::1:ff00:0/104 and the target's last 24 bits).
#[inline(always)]
fn is_solicited_node(dst: *const u8, target: *const u8) -> bool {
    const PREFIX: [u8; 13] = [0xff, 0x02, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 0xff];
    let (d0, _) = addr_words(dst);
    unsafe {
        d0 == u64::from_ne_bytes([PREFIX[0], PREFIX[1], PREFIX[2], PREFIX[3], PREFIX[4], PREFIX[5], PREFIX[6], PREFIX[7]])
            && read_unaligned(dst.add(8) as *const u32) == u32::from_ne_bytes([PREFIX[8], PREFIX[9], PREFIX[10], PREFIX[11]])
            && *dst.add(12) == PREFIX[12]
            && *dst.add(13) == *target.add(13)
            && *dst.add(14) == *target.add(14)
            && *dst.add(15) == *target.add(15)
    }
}

/// [`ndp_handle`] as a function of its own (BPF to BPF), as arp::arp_call, its
/// verdict packed ([`verdict_pack`]).
#[inline(never)]
pub fn ndp_call<const L2: usize>(ctx: *mut xdp_md, s: *mut Scratch, ifindex: u32) -> u64 {
    let ctx = XdpContext::new(ctx);
    verdict_pack(match ndp_handle::<L2>(&ctx, s, ifindex) {
        Ok((action, reason, bytes)) => {
            unsafe { (*s).bytes = bytes as u32 };
            (action, reason)
        }
        Err(()) => {
            unsafe { (*s).bytes = frame_len(&ctx) as u32 };
            (xdp_action::XDP_DROP, Reason::DropMalformed)
        }
    })
}

/// IPv6 behind an `L2`-byte layer-2 header, received on the network of
/// `ifindex`: a Neighbor Solicitation for a VIP held there is answered with the
/// advertisement RFC 4861 7.2.4 asks for (XDP_TX); a Neighbor Advertisement in
/// which another MAC claims such a VIP is counted as `ndp_conflict`; everything
/// else passes untouched. The verdict, its reason and the bytes to count (the
/// layer-2 header, the IPv6 header and its payload length).
#[inline(always)]
fn ndp_handle<const L2: usize>(ctx: &XdpContext, s: *mut Scratch, ifindex: u32) -> Result<(u32, Reason, usize), ()> {
    let ip: *const Ipv6Hdr = ptr_at(ctx, L2)?;
    let (vcf0, payload_len, next_hdr, hop_limit) =
        unsafe { ((*ip).vcf[0], usize::from(u16::from_be_bytes((*ip).payload_len)), (*ip).next_hdr, (*ip).hop_limit) };
    if vcf0 >> 4 != 6 {
        return Err(());
    }
    let bytes = L2 + IP6 + payload_len;
    let pass = |reason| Ok((xdp_action::XDP_PASS, reason, bytes));
    // Neighbour discovery carries no extension headers in practice; one that
    // does is left to the kernel (which does not answer for a VIP either).
    if next_hdr != IPPROTO_ICMPV6 {
        return pass(Reason::PassedOther);
    }
    let Ok(icmp_type) = ptr_at::<u8>(ctx, L2 + IP6) else { return pass(Reason::PassedOther) };
    let icmp_type = unsafe { *icmp_type };
    if icmp_type != ND_NEIGHBOR_SOLICIT && icmp_type != ND_NEIGHBOR_ADVERT {
        let nd = (ND_ROUTER_SOLICIT..=ND_REDIRECT).contains(&icmp_type);
        return pass(if nd { Reason::NdpOther } else { Reason::PassedOther });
    }
    // RFC 4861 7.1.1 and 7.1.2, for both: hop limit 255 (from no router), code
    // 0, at least ND_LEN bytes, a target that is not multicast, options well formed.
    let Ok(nd) = ptr_at::<[u8; ND_LEN]>(ctx, L2 + IP6) else { return pass(Reason::NdpInvalid) };
    let nd = nd as *const u8;
    let target = unsafe { nd.add(8) };
    if hop_limit != 255 || unsafe { *nd.add(1) } != 0 || payload_len < ND_LEN || unsafe { *target } == 0xff {
        return pass(Reason::NdpInvalid);
    }
    // 7.1.1 and 7.1.2: a valid ICMPv6 checksum, over the pseudo-header (both
    // addresses, the length and next header) and the message.
    let (src, dst) = unsafe { ((ip as *const u8).add(8), (ip as *const u8).add(24)) };
    let mut sum = csum_start(payload_len as u32);
    for i in 0..(32 + ND_LEN) / 8 {
        sum = csum_add(sum, unsafe { read_unaligned(src.add(8 * i) as *const u64) });
    }
    unsafe { (*s).csum = sum };
    let Some(opts) = nd_options::<L2>(ctx, payload_len - ND_LEN, s) else { return pass(Reason::NdpInvalid) };
    if csum_fold(unsafe { (*s).csum }) != 0xffff {
        return pass(Reason::NdpInvalid);
    }
    if icmp_type == ND_NEIGHBOR_ADVERT {
        // 7.1.2: an advertisement to a multicast group is never solicited.
        if unsafe { *dst } == 0xff && unsafe { *nd.add(4) } & NA_FLAG_SOLICITED != 0 {
            return pass(Reason::NdpInvalid);
        }
        // Someone says the target is at its link-layer address (the option, else
        // the frame's source). Another MAC than ours for a VIP we hold fresh here:
        // two nodes claim it.
        let claimed = match opts.tlla {
            Some(m) => m,
            None => unsafe { read_unaligned((ip as *const u8).sub(L2 - 6) as *const [u8; 6]) },
        };
        return match ndp_held_fresh(s, ifindex, target) {
            Ok(h) if claimed != unsafe { (*h).mac } => {
                ndp_conflict_record(s);
                pass(Reason::NdpConflict)
            }
            _ => pass(Reason::NdpOther),
        };
    }
    let (s0, s1) = addr_words(src);
    let dad = s0 == 0 && s1 == 0;
    // 7.1.1: no source link-layer option from the unspecified address, whose
    // solicitation goes to the solicited-node group. Ours also: the destination
    // is that group or the target itself (a unicast probe of an entry).
    let (d, t) = (addr_words(dst), addr_words(target));
    let to_target = !dad && d == t;
    if (dad && opts.slla) || !(to_target || is_solicited_node(dst, target)) {
        return pass(Reason::NdpInvalid);
    }
    let h = match ndp_held_fresh(s, ifindex, target) {
        Ok(h) => h,
        Err(reason) => return pass(reason),
    };
    // The advertisement is NA_LEN bytes of ICMPv6: the frame grows or shrinks to
    // it (options of the solicitation go). The helper moves the packet pointers.
    let delta = (L2 + IP6 + NA_LEN) as i32 - frame_len(ctx) as i32;
    if delta != 0 && unsafe { bpf_xdp_adjust_tail(ctx.ctx, delta) } != 0 {
        return pass(Reason::NdpOther);
    }
    let p: *mut [u8; IP6 + NA_LEN] = ptr_at(ctx, L2)?;
    unsafe {
        let p = p as *mut u8;
        let eth = p.sub(L2);
        let mac = (&raw const (*h).mac) as *const u8;
        // Ethernet and IPv6 destinations: the solicitation's source, or all-nodes
        // (33:33:00:00:00:01, ff02::1) for duplicate address detection (7.2.4).
        if dad {
            write_unaligned(eth as *mut u32, u32::from_ne_bytes([0x33, 0x33, 0, 0]));
            write_unaligned(eth.add(4) as *mut u16, u16::from_ne_bytes([0, 1]));
            write_unaligned(p.add(24) as *mut u64, u64::from_ne_bytes([0xff, 0x02, 0, 0, 0, 0, 0, 0]));
            write_unaligned(p.add(32) as *mut u64, u64::from_ne_bytes([0, 0, 0, 0, 0, 0, 0, 1]));
        } else {
            let src_lo = read_unaligned(eth.add(6) as *const u32);
            let src_hi = read_unaligned(eth.add(10) as *const u16);
            write_unaligned(eth as *mut u32, src_lo);
            write_unaligned(eth.add(4) as *mut u16, src_hi);
            write_unaligned(p.add(24) as *mut u64, s0);
            write_unaligned(p.add(32) as *mut u64, s1);
        }
        // Our MAC: the frame's source and the target link-layer address option.
        let mac_lo = read_unaligned(mac as *const u32);
        let mac_hi = read_unaligned(mac.add(4) as *const u16);
        write_unaligned(eth.add(6) as *mut u32, mac_lo);
        write_unaligned(eth.add(10) as *mut u16, mac_hi);
        // From the target (the VIP), which stays in place in the message.
        write_unaligned(p.add(8) as *mut u64, t.0);
        write_unaligned(p.add(16) as *mut u64, t.1);
        write_unaligned(p as *mut u32, u32::from_ne_bytes([0x60, 0, 0, 0]));
        write_unaligned(p.add(4) as *mut u32, u32::from_ne_bytes([0, NA_LEN as u8, IPPROTO_ICMPV6, 255]));
        let flags = if dad { NA_FLAG_OVERRIDE } else { NA_FLAG_SOLICITED | NA_FLAG_OVERRIDE };
        let icmp = p.add(IP6);
        write_unaligned(icmp as *mut u32, u32::from_ne_bytes([ND_NEIGHBOR_ADVERT, 0, 0, 0]));
        write_unaligned(icmp.add(4) as *mut u32, u32::from_ne_bytes([flags, 0, 0, 0]));
        write_unaligned(icmp.add(ND_LEN) as *mut u16, u16::from_ne_bytes([ND_OPT_TARGET_LL_ADDR, 1]));
        write_unaligned(icmp.add(ND_LEN + 2) as *mut u32, mac_lo);
        write_unaligned(icmp.add(ND_LEN + 6) as *mut u16, mac_hi);
        // The checksum, summed from the words just written rather than read back
        // by a helper: the pseudo-header (the target as source, the
        // destination, the length and next header), then the message.
        let (d0, d1) = addr_words(p.add(24));
        let mut sum = csum_start(NA_LEN as u32);
        sum = csum_add(csum_add(csum_add(csum_add(sum, t.0), t.1), d0), d1);
        sum += u64::from(u32::from_ne_bytes([ND_NEIGHBOR_ADVERT, 0, 0, 0])) + u64::from(u32::from_ne_bytes([flags, 0, 0, 0]));
        sum = csum_add(csum_add(sum, t.0), t.1);
        sum += u64::from(u16::from_ne_bytes([ND_OPT_TARGET_LL_ADDR, 1])) + u64::from(mac_lo) + u64::from(mac_hi);
        write_unaligned(icmp.add(2) as *mut u16, !csum_fold(sum));
    }
    Ok((xdp_action::XDP_TX, Reason::NdpAnswered, bytes))
}
