//! IPv4 load balancing: flow table, else Maglev ring, then L2 direct server return.
use aya_ebpf::{bindings::xdp_action, programs::XdpContext};
use network_types::{eth::EthHdr, ip::Ipv4Hdr};
use vip_common::*;

use crate::{
    arp::arp_held_entry,
    maps::{lb4_backends, lb4_flows, lb4_ring, lb4_services},
    parse::{ptr_at, Verdict},
    stats,
};

const IPPROTO_ICMP: u8 = 1;
/// More-fragments flag and fragment offset, in the host-order `frags` word.
const IP_MF_OFFSET: u16 = 0x3fff;

#[inline(always)]
pub fn lb4_handle(ctx: &XdpContext, ifindex: u32, off: usize) -> Result<Verdict, ()> {
    let iph: *const Ipv4Hdr = ptr_at(ctx, off)?;
    let ip = unsafe { &*iph };
    let ihl = ((ip.vihl & 0x0f) as usize) * 4;
    if ip.vihl >> 4 != 4 || ihl < Ipv4Hdr::LEN {
        return Err(());
    }
    let proto = ip.proto;
    if proto == IPPROTO_ICMP {
        // Pings and ICMP errors for a VIP belong to the node's own stack.
        return Ok((xdp_action::XDP_PASS, Reason::PassedIcmp));
    }
    if proto != PROTO_TCP && proto != PROTO_UDP {
        return Ok((xdp_action::XDP_PASS, Reason::PassedNotVip));
    }
    let (src, dst) = (ip.src_addr, ip.dst_addr);
    let fragment = u16::from_be_bytes(ip.frags) & IP_MF_OFFSET != 0;
    // Fragments carry no ports past the first: all fragments of a datagram hash on
    // (src, dst, proto) and use the VIP's port-0 service entry.
    let (sport, dport) = if fragment {
        ([0u8; 2], [0u8; 2])
    } else {
        let ports: *const [u8; 4] = ptr_at(ctx, off + (ihl & 0x3c))?;
        let p = unsafe { *ports };
        ([p[0], p[1]], [p[2], p[3]])
    };
    let skey = ServiceKey { vip: dst, port: dport, proto, _pad: 0 };
    let svc = match unsafe { lb4_services.get(&skey) } {
        Some(s) => *s,
        None if fragment => return Ok((xdp_action::XDP_PASS, Reason::PassedFragmentNoService)),
        None => return Ok((xdp_action::XDP_PASS, Reason::PassedNotVip)),
    };
    let (mac, fresh) = match arp_held_entry(ifindex, dst) {
        Some(h) => h,
        // Not ours to balance (another node owns it): the frame was sent to this
        // node as a backend, or is stray; the stack decides.
        None => return Ok((xdp_action::XDP_PASS, Reason::PassedNotOwner)),
    };
    let fkey = FlowKey { src, dst, sport, dport, proto, _pad: [0; 3] };
    let (backend_id, backend) = match lb4_flow_backend(&fkey) {
        Some(b) => b,
        // A stale entry (fenced, or released when the VIP moved) takes no new flow,
        // but keeps the flows it already pinned: a client still sending to our MAC
        // until the new owner's gratuitous ARP reaches it keeps its connection
        // instead of getting a RST from our stack.
        None if !fresh => return Ok((xdp_action::XDP_PASS, Reason::PassedNotOwner)),
        None => match lb4_ring_backend(&svc, &fkey) {
            Some((id, b)) => {
                let _ = lb4_flows.insert(&fkey, &Flow { backend: id, _pad: 0 }, 0);
                (id, b)
            }
            None => return Ok((xdp_action::XDP_DROP, Reason::DropNoBackend)),
        },
    };
    let bytes = ctx.data_end() - ctx.data();
    stats::count_service(svc.id, bytes);
    stats::count_backend(backend_id, bytes);
    if backend.flags & BACKEND_LOCAL != 0 {
        return Ok((xdp_action::XDP_PASS, Reason::PassedLocalBackend));
    }
    let eth: *mut EthHdr = ptr_at(ctx, 0)?;
    unsafe {
        (*eth).dst_addr = backend.mac;
        (*eth).src_addr = mac;
    }
    Ok((xdp_action::XDP_TX, Reason::Forwarded))
}

/// The backend recorded for this flow, if it still exists. A flow whose backend
/// was removed (unhealthy, drained) is re-hashed on the current ring.
#[inline(always)]
fn lb4_flow_backend(fkey: &FlowKey) -> Option<(u32, Backend)> {
    let id = unsafe { lb4_flows.get(fkey) }?.backend;
    match lb4_backends.get(id) {
        Some(b) if b.flags & BACKEND_PRESENT != 0 => Some((id, *b)),
        _ => {
            stats::count_reason(Reason::FlowRehashed, 0);
            None
        }
    }
}

/// Maglev lookup: the slot the flow hash picks in the service's ring.
#[inline(always)]
fn lb4_ring_backend(svc: &Service, fkey: &FlowKey) -> Option<(u32, Backend)> {
    if svc.ring_size == 0 {
        return None;
    }
    let hash = flow_hash(fkey.src, fkey.dst, fkey.sport, fkey.dport, fkey.proto);
    let slot = svc.ring_offset.wrapping_add(hash % svc.ring_size);
    let id = *lb4_ring.get(slot)?;
    if id == NO_BACKEND {
        return None;
    }
    let b = lb4_backends.get(id)?;
    if b.flags & BACKEND_PRESENT == 0 {
        return None;
    }
    Some((id, *b))
}
