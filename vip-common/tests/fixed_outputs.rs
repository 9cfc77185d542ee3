//! The hashes both sides compute, held to fixed outputs. Agents of two releases
//! run side by side during an upgrade and a VIP moves between them: the flow
//! hash picks a flow's ring slot on whichever node holds the VIP, and the flow
//! table's hash finds the flows an older agent pinned. A change to either that
//! still passes every other test (the fixtures predict with these same
//! functions) sends established flows to other backends when the VIP moves
//! between an old and a new agent, or loses their pins on an upgrade. These
//! tests fail on purpose then: a hash may change only with a migration and a
//! changelog entry that says what it breaks.

use vip_common::*;

/// An IPv4 5-tuple: source, destination, ports (host order), protocol.
type Tuple4 = ([u8; 4], [u8; 4], u16, u16, u8);

const V4: [Tuple4; 4] = [
    ([198, 18, 0, 10], [198, 19, 0, 1], 40000, 80, PROTO_TCP),
    ([198, 18, 0, 11], [198, 19, 0, 1], 40000, 80, PROTO_TCP),
    ([198, 18, 0, 10], [198, 19, 0, 1], 40001, 443, PROTO_UDP),
    ([198, 18, 0, 10], [198, 19, 0, 1], 0, 0, PROTO_UDP),
];

fn v6(last: u8) -> [u8; 16] {
    [0x20, 0x01, 0x0d, 0xb8, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, last]
}

#[test]
fn the_ring_flow_hash_of_ipv4_and_ipv6_flows_is_fixed() {
    let v4: Vec<u32> = V4.iter().map(|&(s, d, sp, dp, p)| flow_hash(s, d, sp.to_be_bytes(), dp.to_be_bytes(), p)).collect();
    let v6: Vec<u32> = [(10, 40000, 80), (11, 40000, 80), (10, 0, 0)]
        .iter()
        .map(|&(l, sp, dp): &(u8, u16, u16)| flow_hash6(v6(l), v6(1), sp.to_be_bytes(), dp.to_be_bytes(), PROTO_TCP))
        .collect();
    assert_eq!(v4, [0x1999_f674, 0x255d_a242, 0x33d6_6e6e, 0x5f3a_0e29]);
    assert_eq!(v6, [0x346f_7cab, 0x7b7a_fa91, 0x8051_e77e]);
}

#[test]
fn the_flow_tables_hash_set_and_tag_are_fixed() {
    let seed = [0x0123_4567_89ab_cdef, 0xfedc_ba98_7654_3210];
    let out: Vec<(u64, u32, u64)> = V4
        .iter()
        .map(|&(s, d, sp, dp, p)| {
            let key = Lb4FlowKey { src: s, dst: d, sport: sp.to_be_bytes(), dport: dp.to_be_bytes(), proto: p, _pad: [0; 3] };
            let h = lb_flow_hash(&seed, FLOW_FAMILY_V4, &key.words());
            (h, lb_flow_set(h), lb_flow_tag(h, 7))
        })
        .collect();
    let key6 = Lb6FlowKey { src: v6(10), dst: v6(1), sport: 40000u16.to_be_bytes(), dport: 80u16.to_be_bytes(), proto: PROTO_TCP, _pad: [0; 3] };
    let h6 = lb_flow_hash(&seed, FLOW_FAMILY_V6, &key6.words());
    let (w0, w1) = fold_words6(&key6.words());
    let slots = (first_packet_slot(w0, w1), first_packet_check(w0, w1, 3), flow_cache_slot(w0, w1), lb_flow_check(lb_flow_tag(h6, 7), 3));
    assert_eq!(
        out,
        [
            (0x0edb_8746_4964_9a29, 0x3b6e, 0x0007_8746_4964_9a29),
            (0xc6a8_ad19_10e4_d91b, 0x3_1aa2, 0x0007_ad19_10e4_d91b),
            (0x2fa9_35de_a9e7_4fdd, 0xbea4, 0x0007_35de_a9e7_4fdd),
            (0x4956_cac6_03c6_8e21, 0x1_255b, 0x0007_cac6_03c6_8e21),
        ]
    );
    assert_eq!(h6, 0xd8a2_463f_6e84_f175);
    assert_eq!(slots, (0x2874, 0x554b_ff12, 0xa1d, 0xb556));
}

#[test]
fn the_address_bitmaps_bits_are_fixed() {
    let bits = [vip_filter_bit([198, 19, 0, 1]), vip_filter_bit6(v6(1)), held_slot(vip_filter_bit([198, 19, 0, 1])), node_mac_key([2, 0, 0, 0, 0, 1]) as u32];
    assert_eq!(bits, [0x2df0, 0xd359, 0xdf0, 0x2]);
}
