//! NDP: answer IPv6 Neighbor Solicitations (RFC 4861) for VIPs this node holds
//! on the receiving interface, the IPv6 twin of arp.rs. Other IPv6 passes.
use core::{
    ffi::c_void,
    ptr::{read_unaligned, read_volatile, write_unaligned, write_volatile},
};

use aya_ebpf::{
    bindings::{xdp_action, xdp_md},
    helpers::{bpf_ktime_get_coarse_ns, bpf_xdp_adjust_tail, bpf_xdp_load_bytes},
    programs::XdpContext,
};
use network_types::{eth::EthHdr, icmp::Icmpv6Hdr, ip::Ipv6Hdr};
use vip_common::{HeldVip, NdpHeldKey, Reason};

use crate::{
    arp::held_fresh,
    lb::lb_copy_mac,
    maps::{held6_slot, lookup_at, ndp_conflicts, ndp_held, Scratch},
    parse::{frame_len, ptr_at, verdict_pack_or_malformed, Verdict},
    proto::{IP6, IPPROTO_ICMPV6, ND_NEIGHBOR_ADVERT, ND_NEIGHBOR_SOLICIT, ND_REDIRECT, ND_ROUTER_SOLICIT},
};

/// Neighbour discovery's link-layer address options (RFC 4861, 4.6.1).
const ND_OPT_SOURCE_LL_ADDR: u8 = 1;
const ND_OPT_TARGET_LL_ADDR: u8 = 2;
/// A Neighbor Solicitation or Advertisement (RFC 4861 4.3, 4.4) after its IPv6
/// header: the ICMPv6 header, whose four data bytes are the advertisement's
/// flags and reserved (the solicitation's reserved), then the target address;
/// options follow.
#[repr(C)]
struct NdMsg {
    icmp: Icmpv6Hdr,
    target: [u8; 16],
}

/// The IPv6 header and the message, read and written at fixed offsets.
#[repr(C)]
struct NdPacket {
    ip: Ipv6Hdr,
    nd: NdMsg,
}

/// The message before its options: 24 bytes.
const ND_LEN: usize = core::mem::size_of::<NdMsg>();
/// Where the answer's fields are, from the IPv6 header on (the Ethernet
/// header's from its start).
const SRC: usize = core::mem::offset_of!(Ipv6Hdr, src_addr);
const DST: usize = core::mem::offset_of!(Ipv6Hdr, dst_addr);
const TARGET: usize = IP6 + core::mem::offset_of!(NdMsg, target);
const ETH_SRC: usize = core::mem::offset_of!(EthHdr, src_addr);
/// The advertisement sent: ND_LEN and one target link-layer address option.
const NA_LEN: usize = ND_LEN + 8;
const NA_FLAG_SOLICITED: u8 = 0x40;
const NA_FLAG_OVERRIDE: u8 = 0x20;
/// Options walked at most (a solicitation carries one or two: source
/// link-layer address, nonce); more is taken as malformed.
const ND_MAX_OPTIONS: usize = 8;

/// What the options of a message say, as one word (0: malformed): these bits,
/// and the target link-layer address option's MAC in the top six bytes.
const OPT_OK: u64 = 1;
const OPT_SLLA: u64 = 2;
const OPT_TLLA: u64 = 4;

/// Notes the option `w` (8 bytes as loaded, as neighbour discovery's options
/// are) in the options word `o` (see OPT_OK): 0 if its length field is not 1.
/// Kept as one word: its bytes apart would each take a register.
#[inline(always)]
fn nd_option(o: u64, w: u64) -> u64 {
    let [kind, len, ..] = w.to_le_bytes();
    if len != 1 {
        return 0;
    }
    match kind {
        ND_OPT_SOURCE_LL_ADDR => o | OPT_SLLA,
        ND_OPT_TARGET_LL_ADDR => o & 0xffff | w & !0xffff | OPT_TLLA,
        _ => o,
    }
}

/// Walks the `len` bytes of options after an `L2`-byte layer-2 header, the IPv6
/// header and ND_LEN: each is 8 bytes long (its length field 1), none runs past
/// the end, at most ND_MAX_OPTIONS. What they say (see OPT_OK); each is added to
/// the checksum sum in the scratch's `csum` (see [`csum_add`]). Options
/// neighbour discovery uses are 8 bytes (link-layer addresses, nonce); a longer
/// one (SEcure Neighbor Discovery's) makes the message malformed here. One or
/// two options (all a solicitation or advertisement carries in practice) are
/// read at constant offsets, without a helper, and inlined: the sum goes
/// through the scratch, so that no register is spilled (see maps::LB_KEY0), and
/// no call's return is paid (the kernel's return thunk makes each dear). More
/// go to [`nd_options_more`], a function of its own.
#[inline(always)]
fn nd_options<const L2: usize>(ctx: *mut xdp_md, s: *mut Scratch, len: usize) -> u64 {
    const AT: usize = IP6 + ND_LEN;
    if len > 16 {
        return nd_options_more::<L2>(ctx, s, len);
    }
    let ctx = XdpContext::new(ctx);
    let mut o = OPT_OK;
    // Options end where `len` says: at 0, 8 or 16 bytes here.
    for (at, end) in [(L2 + AT, 8), (L2 + AT + 8, 16)] {
        if len + 8 <= end {
            break;
        }
        if len < end {
            return 0;
        }
        o = nd_option_at(&ctx, s, at, o);
        if o == 0 {
            return 0;
        }
    }
    o
}

/// The option at the constant offset `at` noted in the options word `o` ([`nd_option`])
/// and added to the scratch's sum; 0 if the frame ends before it or it is malformed.
#[inline(always)]
fn nd_option_at(ctx: &XdpContext, s: *mut Scratch, at: usize, o: u64) -> u64 {
    let Ok(w) = ptr_at::<u64>(ctx, at) else { return 0 };
    let w = unsafe { read_unaligned(w) };
    unsafe { write_volatile(&raw mut (*s).csum, csum_add(read_volatile(&(*s).csum), w)) };
    nd_option(o, w)
}

/// [`nd_options`] for more than two options, read with a helper: their offsets
/// vary, and a variable offset added to a packet pointer needs CAP_PERFMON (see
/// parse::ETH_LEN). A function of its own, so that the values it keeps across
/// those calls are not spilled on the common path too.
#[inline(never)]
fn nd_options_more<const L2: usize>(ctx: *mut xdp_md, s: *mut Scratch, len: usize) -> u64 {
    let mut o = OPT_OK;
    let mut off = 0usize;
    // A word, not bytes: the verifier wants stack accesses aligned.
    let mut w = 0u64;
    for _ in 0..ND_MAX_OPTIONS {
        if off == len {
            return o;
        }
        if off + 8 > len {
            return 0;
        }
        let at = (L2 + IP6 + ND_LEN + off) as u32;
        if unsafe { bpf_xdp_load_bytes(ctx, at, (&raw mut w).cast::<c_void>(), 8) } != 0 {
            return 0; // the frame ends before the payload length says
        }
        o = nd_option(o, w);
        if o == 0 {
            return 0;
        }
        unsafe { (*s).csum = csum_add((*s).csum, w) };
        off += 8;
    }
    if off == len {
        o
    } else {
        0
    }
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

/// As arp::arp_held_fresh: this node's entry for the VIP of the key in this
/// CPU's scratch (`held6`, see maps::LB_KEY0) if it holds it now (fresh) and
/// announces it, else why not.
#[inline(always)]
fn ndp_held_fresh(s: *mut Scratch) -> Result<*const HeldVip, Reason> {
    let now = unsafe { bpf_ktime_get_coarse_ns() };
    // Its copy in `lb6_held_slots` first, as arp::arp_held_get.
    let h = match held6_slot(s) {
        Some(h) => Some(h),
        None => lookup_at::<_, HeldVip>(&ndp_held, unsafe { (&raw const (*s).held6).cast() }).map(|h| h as *const HeldVip),
    };
    held_fresh(now, h, [Reason::NdpNotHeld, Reason::NdpNotAnnounced, Reason::NdpStale])
}

/// Counts a conflict in `ndp_conflicts` (as arp::arp_conflict_record) on the key
/// in this CPU's scratch: the unaligned 16-byte address cannot be copied into a
/// key on the stack, where the verifier wants every access aligned.
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

/// The address at `a` as two words.
#[inline(always)]
fn addr_words(a: *const [u8; 16]) -> (u64, u64) {
    let w = a.cast::<u64>();
    unsafe { (read_unaligned(w), read_unaligned(w.add(1))) }
}

/// A MAC at `m` as a word and a half-word.
#[inline(always)]
fn mac_words(m: *const [u8; 6]) -> (u32, u16) {
    let m = m.cast::<u8>();
    unsafe { (read_unaligned(m.cast::<u32>()), read_unaligned(m.add(4).cast::<u16>())) }
}

/// Writes a MAC's two words ([`mac_words`]) at `m`.
#[inline(always)]
fn mac_write(m: *mut [u8; 6], (lo, hi): (u32, u16)) {
    let m = m.cast::<u8>();
    unsafe {
        write_unaligned(m.cast::<u32>(), lo);
        write_unaligned(m.add(4).cast::<u16>(), hi);
    }
}

/// The Ethernet header `L2` bytes before the IPv6 header at `p` (a VLAN tag, if
/// any, sits between them), checked with `p`.
#[inline(always)]
fn eth_of<const L2: usize>(p: *const NdPacket) -> *mut EthHdr {
    unsafe { p.cast::<u8>().sub(L2).cast::<EthHdr>().cast_mut() }
}

/// Writes the two words of an address ([`addr_words`]) at `a`.
#[inline(always)]
fn addr_write(a: *mut [u8; 16], (w0, w1): (u64, u64)) {
    let w = a.cast::<u64>();
    unsafe {
        write_unaligned(w, w0);
        write_unaligned(w.add(1), w1);
    }
}

/// [`ndp_handle`] as a function of its own (BPF to BPF), as arp::arp_call, its
/// verdict packed ([`verdict_pack_or_malformed`]).
#[inline(never)]
pub fn ndp_call<const L2: usize>(ctx: *mut xdp_md, s: *mut Scratch, ifindex: u32) -> u64 {
    let ctx = XdpContext::new(ctx);
    verdict_pack_or_malformed(&ctx, s, ndp_handle::<L2>(&ctx, s, ifindex))
}

/// IPv6 behind an `L2`-byte layer-2 header, received on the network of
/// `ifindex`: a Neighbor Solicitation for a VIP held there is answered with the
/// advertisement RFC 4861 7.2.4 asks for (XDP_TX); a Neighbor Advertisement in
/// which another MAC claims such a VIP is counted as `ndp_conflict`; everything
/// else passes untouched. As in lb4_handle, only `ctx` and `s` live across the
/// held entry's lookup: [`nd_parse`] leaves what is needed after it in the
/// scratch, or it is read from the packet again (each value kept in a register
/// past the four callee-saved ones is a spill, and a speculation barrier without
/// CAP_PERFMON; see maps::LB_KEY0).
#[inline(always)]
fn ndp_handle<const L2: usize>(ctx: &XdpContext, s: *mut Scratch, ifindex: u32) -> Result<Verdict, ()> {
    let pass = |reason| Ok((xdp_action::XDP_PASS, reason));
    let advert = match nd_parse::<L2>(ctx, s, ifindex)? {
        Ok(advert) => advert,
        Err(reason) => return pass(reason),
    };
    if advert {
        // Someone says the target is at its link-layer address (in the scratch's
        // `mac`). Another MAC than ours for a VIP we hold fresh here: two nodes
        // claim it.
        return match ndp_held_fresh(s) {
            Ok(h) if unsafe { (*s).mac != (*h).mac } => {
                ndp_conflict_record(s);
                pass(Reason::NdpConflict)
            }
            _ => pass(Reason::NdpOther),
        };
    }
    let h = match ndp_held_fresh(s) {
        Ok(h) => h,
        Err(reason) => return pass(reason),
    };
    lb_copy_mac(unsafe { &raw mut (*s).mac }, unsafe { &raw const (*h).mac });
    ndp_advertise::<L2>(ctx, s)
}

/// Checks a Neighbor Solicitation or Advertisement as RFC 4861 7.1.1 and 7.1.2
/// ask: for both, hop limit 255 (from no router), code 0, at least ND_LEN
/// bytes, a target that is not multicast, options well formed, a valid ICMPv6
/// checksum; for each, its own rules. Whether it is an advertisement, else the
/// reason to pass it. The bytes to count (the layer-2 header, the IPv6 header
/// and its payload length), the `ndp_held` key (`ifindex`, the target) and, for
/// an advertisement, the MAC it claims go to the scratch `s`.
#[inline(always)]
fn nd_parse<const L2: usize>(ctx: &XdpContext, s: *mut Scratch, ifindex: u32) -> Result<Result<bool, Reason>, ()> {
    // ff02::1:ff00:0/104: the solicited-node prefix, as its two words load.
    const SN0: u64 = u64::from_ne_bytes([0xff, 0x02, 0, 0, 0, 0, 0, 0]);
    const SN1: u64 = u64::from_ne_bytes([0, 0, 0, 1, 0xff, 0, 0, 0]);
    const LOW24: u64 = u64::from_ne_bytes([0, 0, 0, 0, 0, 0xff, 0xff, 0xff]);
    let ip: *const Ipv6Hdr = ptr_at(ctx, L2)?;
    let (vcf0, payload_len, next_hdr, hop_limit) =
        unsafe { ((*ip).vcf[0], usize::from(u16::from_be_bytes((*ip).payload_len)), (*ip).next_hdr, (*ip).hop_limit) };
    if vcf0 >> 4 != 6 {
        return Err(());
    }
    unsafe { write_volatile(&raw mut (*s).bytes, (L2 + IP6 + payload_len) as u32) };
    // Neighbour discovery carries no extension headers in practice; one that
    // does is left to the kernel (which does not answer for a VIP either).
    if next_hdr != IPPROTO_ICMPV6 {
        return Ok(Err(Reason::PassedOther));
    }
    let Ok(icmp_type) = ptr_at::<u8>(ctx, L2 + IP6) else { return Ok(Err(Reason::PassedOther)) };
    let icmp_type = unsafe { *icmp_type };
    if icmp_type != ND_NEIGHBOR_SOLICIT && icmp_type != ND_NEIGHBOR_ADVERT {
        let nd = (ND_ROUTER_SOLICIT..=ND_REDIRECT).contains(&icmp_type);
        return Ok(Err(if nd { Reason::NdpOther } else { Reason::PassedOther }));
    }
    let Ok(p) = ptr_at::<NdPacket>(ctx, L2) else { return Ok(Err(Reason::NdpInvalid)) };
    if hop_limit != 255 || unsafe { (*p).nd.icmp.code } != 0 || payload_len < ND_LEN || unsafe { (*p).nd.target[0] } == 0xff {
        return Ok(Err(Reason::NdpInvalid));
    }
    // The pseudo-header (both addresses, the length and next header) and the
    // message, summed for the checksum: the words from the source address on.
    unsafe { (*s).held6.ifindex = ifindex };
    let mut sum = csum_start(payload_len as u32);
    let from = unsafe { (&raw const (*p).ip.src_addr).cast::<u64>() };
    for i in 0..(32 + ND_LEN) / 8 {
        sum = csum_add(sum, unsafe { read_unaligned(from.add(i)) });
    }
    unsafe { (*s).csum = sum };
    let o = nd_options::<L2>(ctx.ctx, s, payload_len - ND_LEN);
    if o == 0 || csum_fold(unsafe { (*s).csum }) != 0xffff {
        return Ok(Err(Reason::NdpInvalid));
    }
    // What is needed next is read from the packet again rather than kept across
    // the walk, and after the stores below too: a store to the scratch
    // may alias the packet, so the compiler reloads, and few words are live at
    // a time. The target to the `ndp_held` key.
    let Ok(p) = ptr_at::<NdPacket>(ctx, L2) else { return Ok(Err(Reason::NdpInvalid)) };
    let (t0, t1) = addr_words(unsafe { &raw const (*p).nd.target });
    addr_write(unsafe { &raw mut (*s).held6.vip }, (t0, t1));
    if unsafe { (*p).nd.icmp.type_ } == ND_NEIGHBOR_ADVERT {
        // 7.1.2: an advertisement to a multicast group is never solicited.
        if unsafe { (*p).ip.dst_addr[0] == 0xff && (*p).nd.icmp.data[0] & NA_FLAG_SOLICITED != 0 } {
            return Ok(Err(Reason::NdpInvalid));
        }
        // What it claims: the target link-layer address option's MAC, else the
        // frame's source.
        let (lo, hi) = if o & OPT_TLLA != 0 { ((o >> 16) as u32, (o >> 48) as u16) } else { mac_words(unsafe { &raw const (*eth_of::<L2>(p)).src_addr }) };
        mac_write(unsafe { &raw mut (*s).mac }, (lo, hi));
        return Ok(Ok(true));
    }
    // 7.1.1: no source link-layer option from the unspecified address, whose
    // solicitation goes to the solicited-node group. Ours also: the destination
    // is that group or the target itself (a unicast probe of an entry).
    let (s0, s1) = addr_words(unsafe { &raw const (*p).ip.src_addr });
    let dad = s0 | s1 == 0;
    if dad && o & OPT_SLLA != 0 {
        return Ok(Err(Reason::NdpInvalid));
    }
    let (d0, d1) = addr_words(unsafe { &raw const (*p).ip.dst_addr });
    let to_target = !dad && d0 == t0 && d1 == t1;
    if !to_target && !(d0 == SN0 && d1 & !LOW24 == SN1 && (d1 ^ t1) & LOW24 == 0) {
        return Ok(Err(Reason::NdpInvalid));
    }
    Ok(Ok(false))
}

/// Turns the solicitation in `ctx` into the advertisement for its target from
/// the MAC in the scratch `s` (ours for it), in place. The frame grows or
/// shrinks to NA_LEN bytes of ICMPv6 (options of the solicitation go), with a
/// helper only when it is not that long already (the solicitations of Linux and
/// others are: one 8-byte option, source link-layer address or nonce).
#[inline(always)]
fn ndp_advertise<const L2: usize>(ctx: &XdpContext, s: *mut Scratch) -> Result<Verdict, ()> {
    const LEN: usize = IP6 + NA_LEN;
    if ptr_at::<[u8; LEN + 1]>(ctx, L2).is_ok() || ptr_at::<[u8; LEN]>(ctx, L2).is_err() {
        // The helper moves the packet pointers: all are taken again below.
        let delta = (L2 + LEN) as i32 - frame_len(ctx) as i32;
        if unsafe { bpf_xdp_adjust_tail(ctx.ctx, delta) } != 0 {
            return Ok((xdp_action::XDP_PASS, Reason::NdpOther));
        }
    }
    // The whole advertisement lies in the frame: the message and its option.
    // Written at the headers' offsets as raw words: typed field writes let the
    // compiler merge the two branches' stores and spill what they keep.
    let p: *mut [u8; LEN] = ptr_at(ctx, L2)?;
    unsafe {
        let p = p as *mut u8;
        let eth = p.sub(L2);
        let mac = (&raw const (*s).mac) as *const u8;
        let (s0, s1) = addr_words(p.add(SRC).cast());
        let t = addr_words(p.add(TARGET).cast());
        let dad = s0 == 0 && s1 == 0;
        // Ethernet and IPv6 destinations: the solicitation's source, or all-nodes
        // (33:33:00:00:00:01, ff02::1) for duplicate address detection (7.2.4).
        if dad {
            write_unaligned(eth as *mut u32, u32::from_ne_bytes([0x33, 0x33, 0, 0]));
            write_unaligned(eth.add(4) as *mut u16, u16::from_ne_bytes([0, 1]));
            write_unaligned(p.add(DST) as *mut u64, u64::from_ne_bytes([0xff, 0x02, 0, 0, 0, 0, 0, 0]));
            write_unaligned(p.add(DST + 8) as *mut u64, u64::from_ne_bytes([0, 0, 0, 0, 0, 0, 0, 1]));
        } else {
            let src_lo = read_unaligned(eth.add(ETH_SRC) as *const u32);
            let src_hi = read_unaligned(eth.add(ETH_SRC + 4) as *const u16);
            write_unaligned(eth as *mut u32, src_lo);
            write_unaligned(eth.add(4) as *mut u16, src_hi);
            write_unaligned(p.add(DST) as *mut u64, s0);
            write_unaligned(p.add(DST + 8) as *mut u64, s1);
        }
        // Our MAC: the frame's source and the target link-layer address option.
        let mac_lo = read_unaligned(mac as *const u32);
        let mac_hi = read_unaligned(mac.add(4) as *const u16);
        write_unaligned(eth.add(ETH_SRC) as *mut u32, mac_lo);
        write_unaligned(eth.add(ETH_SRC + 4) as *mut u16, mac_hi);
        // From the target (the VIP), which stays in place in the message.
        write_unaligned(p.add(SRC) as *mut u64, t.0);
        write_unaligned(p.add(SRC + 8) as *mut u64, t.1);
        write_unaligned(p as *mut u32, u32::from_ne_bytes([0x60, 0, 0, 0]));
        write_unaligned(p.add(4) as *mut u32, u32::from_ne_bytes([0, NA_LEN as u8, IPPROTO_ICMPV6, 255]));
        let flags = if dad { NA_FLAG_OVERRIDE } else { NA_FLAG_SOLICITED | NA_FLAG_OVERRIDE };
        let icmp = p.add(IP6);
        write_unaligned(icmp as *mut u32, u32::from_ne_bytes([ND_NEIGHBOR_ADVERT, 0, 0, 0]));
        write_unaligned(icmp.add(4) as *mut u32, u32::from_ne_bytes([flags, 0, 0, 0]));
        write_unaligned(icmp.add(ND_LEN) as *mut u16, u16::from_ne_bytes([ND_OPT_TARGET_LL_ADDR, 1]));
        write_unaligned(icmp.add(ND_LEN + 2) as *mut u32, mac_lo);
        write_unaligned(icmp.add(ND_LEN + 6) as *mut u16, mac_hi);
        // The checksum, summed from the words just written rather than read back:
        // the pseudo-header (the target as source, the destination, the length
        // and next header), then the message.
        let (d0, d1) = addr_words(p.add(DST).cast());
        let mut sum = csum_start(NA_LEN as u32);
        sum = csum_add(csum_add(csum_add(csum_add(sum, t.0), t.1), d0), d1);
        sum += u64::from(u32::from_ne_bytes([ND_NEIGHBOR_ADVERT, 0, 0, 0])) + u64::from(u32::from_ne_bytes([flags, 0, 0, 0]));
        sum = csum_add(csum_add(sum, t.0), t.1);
        sum += u64::from(u16::from_ne_bytes([ND_OPT_TARGET_LL_ADDR, 1])) + u64::from(mac_lo) + u64::from(mac_hi);
        write_unaligned(icmp.add(2) as *mut u16, !csum_fold(sum));
    }
    Ok((xdp_action::XDP_TX, Reason::NdpAnswered))
}
