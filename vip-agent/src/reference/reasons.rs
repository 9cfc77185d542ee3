//! What each data-path reason means for an operator: the prose of
//! docs/reference/reasons.md. A reason added to `vip_common::Reason` without
//! its meaning here does not compile (the match is exhaustive).

use vip_common::Reason;

/// Why a frame is counted under `r`, and what a rising count means.
pub(super) fn meaning(r: Reason) -> &'static str {
    match r {
        Reason::ArpAnswered => {
            "An ARP request for a VIP this node holds, fresh, on the network it arrived on: answered by the data path (rewritten into the reply and sent back out)."
        }
        Reason::ArpNotHeld => {
            "An ARP request for an address this node does not hold on that network (another node's VIP, or no VIP at all): passed to the kernel, which answers for its own addresses."
        }
        Reason::ArpStale => {
            "An ARP request for a VIP this node holds past its deadline: not answered, passed. The holder's agent stopped refreshing it (hung or stopped), or the VIP was just released; rising on one node means its agent is not running its liveness loop."
        }
        Reason::ArpOther => {
            "ARP that is not a request for a held VIP: replies and gratuitous ARP that claim no VIP of ours, ARP for other hardware or protocol types. Passed untouched."
        }
        Reason::Forwarded => {
            "A packet to a VIP service this node holds, sent to a backend on another node of the same network (destination MAC rewritten, out of the interface it came in on)."
        }
        Reason::PassedLocalBackend => {
            "A packet to a VIP service whose chosen backend is this node: passed to the local stack (kube-proxy's rules, or the VIP on lo in file mode, take it)."
        }
        Reason::PassedNotVip => {
            "An IPv4 or IPv6 packet not addressed to a VIP service (another destination, port or IP protocol): ordinary traffic of the node, passed."
        }
        Reason::PassedNotOwner => {
            "A packet to a VIP service this node does not hold fresh: a frame another node forwarded here as a backend (normal on backends), also to a former holder of the VIP, which never forwards a node's frame again. Passed to the stack."
        }
        Reason::PassedIcmp => {
            "ICMP to a VIP other than an error about one of its balanced flows (pings, and errors the data path does not read: see `forwarded_icmp_error`), or ICMPv6 behind extension headers: passed to the stack, which answers pings to the VIPs it holds."
        }
        Reason::PassedFragmentNoService => {
            "An IPv4 or IPv6 fragment to an address and protocol without a VIP service: passed. (Fragments of VIP services go to one backend per datagram.)"
        }
        Reason::DropMalformed => "A frame whose Ethernet, VLAN, ARP, IPv4 or IPv6 header is truncated or invalid: dropped.",
        Reason::DropNoBackend => {
            "A new flow to a VIP service this node holds whose ring has no backend (no ready, healthy backend node with a known MAC): dropped. See the service's backends and their health with `vip-agent inspect`."
        }
        Reason::FlowRehashed => {
            "An event, not a verdict: a flow whose recorded backend has left (unhealthy, drained or removed) was placed on the service's ring again; its connection most likely breaks."
        }
        Reason::PassedOther => {
            "A frame that is neither ARP, IPv4 nor IPv6 (LLDP, ...), or ICMPv6 that is neither neighbour discovery nor an error about a balanced flow (pings, and errors the data path does not read: see `forwarded_icmp_error`): passed."
        }
        Reason::ArpConflict => {
            "An ARP reply or gratuitous ARP in which another MAC claims a VIP this node holds: two nodes answer for it (a second load balancer, a host with the VIP configured, a partitioned peer). Passed; the agent re-announces the VIP and counts vip_arp_conflicts_total."
        }
        Reason::ArpNotAnnounced => {
            "An ARP request for a VIP of an `announce: lo` pool that this node holds: dropped, so that the node's kernel does not answer for it over ARP (a routing daemon announces the VIP)."
        }
        Reason::DropGroupNotOwner => {
            "A broadcast or multicast frame to a VIP service that this node does not hold fresh: dropped, so that only the holder's stack answers it."
        }
        Reason::PassedVlanOther => {
            "A frame tagged for a VLAN no pool lives on here, or with an 802.1ad (S-tag) or two tags (QinQ): passed untouched."
        }
        Reason::ForwardedHome => {
            "A packet to a VIP of another network than the node's home (another interface, a VLAN), forwarded to its backend out of the home interface, untagged."
        }
        Reason::NdpAnswered => {
            "An IPv6 Neighbor Solicitation for a VIP this node holds, fresh, on the network it arrived on: answered by the data path with a Neighbor Advertisement (Solicited and Override set, our MAC as target link-layer address; to all-nodes for duplicate address detection)."
        }
        Reason::NdpNotHeld => {
            "A valid Neighbor Solicitation for an address this node does not hold on that network (another node's VIP, or no VIP at all): passed to the kernel, which answers for its own addresses."
        }
        Reason::NdpStale => {
            "A Neighbor Solicitation for a VIP this node holds past its deadline: not answered, passed (fenced, as `arp_stale`)."
        }
        Reason::NdpOther => {
            "A Neighbor Advertisement that claims no VIP of ours, or a neighbour discovery message the program leaves to the kernel: passed untouched."
        }
        Reason::NdpInvalid => {
            "A Neighbor Solicitation or Advertisement that fails RFC 4861's checks (hop limit not 255, code not 0, too short, multicast target, an option of length zero or past the end, a source link-layer option from the unspecified address, a destination that is neither the target nor its solicited-node group): not answered, passed (the kernel discards it too)."
        }
        Reason::NdpConflict => {
            "A Neighbor Advertisement in which another MAC claims a VIP this node holds: two nodes answer for it. Passed; the agent re-announces the VIP (as for `arp_conflict`) and counts vip_arp_conflicts_total."
        }
        Reason::FlowEvicted => {
            "An event, not a verdict: a flow's second packet pinned it in the flow table (`lb_flows`) over another flow looked up in the last minute or so (`FLOW_LIVE_STAMPS`), the oldest of the four in its set (a 64-byte line), because all four were taken. Flows idle for longer are replaced without a count (nothing else removes ended flows). A steady rise means more active flows than the table holds (1,048,576 a node), or a flood of flows that send two packets each: an evicted flow's next packet follows the ring again, which breaks it only if the ring changed since it began."
        }
        Reason::PassedIpv6Ext => {
            "An IPv6 packet to a VIP whose extension headers the program does not walk (other than hop-by-hop, routing, destination options and fragment, such as AH or ESP), or a chain of more than six: passed to the stack, not balanced."
        }
        Reason::NdpNotAnnounced => {
            "A Neighbor Solicitation for a VIP of an `announce: lo` pool that this node holds: not answered (a routing daemon announces the VIP), passed; Linux answers solicitations only for the receiving interface's own addresses, so a VIP on lo is not answered by the kernel either."
        }
        Reason::ForwardedIcmpError => {
            "An ICMP destination unreachable (fragmentation needed among them) or ICMPv6 destination unreachable or packet too big about a flow of a VIP service this node holds, sent to the backend that serves the flow (its pin in the flow table, else the ring's choice) as a packet of the flow is: the backend, which answers clients directly, learns the path MTU. Read only when the headers are at fixed places (no IPv4 options, no IPv6 extension headers, outer or inner) and the quoted packet is TCP or UDP from the VIP with its ports; creates no flow. A rise means a path to clients with a smaller MTU than the backends' (normal), or a flood of forged errors."
        }
        Reason::AskedPrevious => {
            "A TCP segment (no SYN) of a flow this node has neither pinned nor seen begin, to a VIP it holds fresh: sent to the VIP's previous holder (`arp_handoff`, `ndp_handoff`), whose pins the flow is most likely in, under a local experimental EtherType, rather than hashed on a ring that may have changed since the flow began. Only while the previous holder's node is a backend here (its data path runs) and its agent's version answers. A burst after a takeover is the connections that began before it; a steady rate means long-lived connections still pinned at the previous holder (each segment takes one hop more)."
        }
        Reason::AskAnsweredPinned => {
            "A segment another node asked this one about (`asked_previous` there): its flow was pinned here, so it goes to the pinned backend (passed when that is this node), its pin refreshed. Answered whether this node holds the VIP or not."
        }
        Reason::AskAnsweredRing => {
            "A segment another node asked this one about, of a flow not pinned here either: sent by the ring, as the asker's would, nothing pinned. A rise means asks for flows neither node knows: connections that began before the previous holder's takeover, or after its flow table evicted them."
        }
        Reason::PassedFromPrevious => {
            "A segment the VIP's previous holder sent this node, the VIP's holder, in answer to an ask (its pin or ring chose this node): passed to the stack, not balanced or asked about again."
        }
        Reason::PassedOtherHost => {
            "A unicast frame to a VIP service this node holds, addressed to another MAC: a switch flooded it here (it has not learnt that MAC, or the port it was learnt on went down), and its own host sees it too. Passed to the stack, which drops it, so that no flow reaches a backend twice. Rising on every node while one is down shows the switch still floods its MAC (clients or the router still send to it)."
        }
        Reason::ArpWatched => {
            "An ARP reply or gratuitous ARP for a VIP another node holds that this node's agent is checking (its ARP self-check asked who answers for it): the sender MAC is recorded in `arp_watch` for the agent, the frame passed. A few per VIP checked, about every 45 s."
        }
    }
}
