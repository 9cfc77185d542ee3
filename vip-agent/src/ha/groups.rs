//! Solicited-node multicast membership for the IPv6 VIPs this node holds.
//!
//! A Neighbor Solicitation for a VIP goes to the VIP's solicited-node group
//! (ff02::1:ffXX:XXXX, Ethernet 33:33:ff:XX:XX:XX): a NIC that filters
//! multicast, a macvlan, or a switch or bridge snooping MLD delivers it only
//! where the group was joined. The holder joins it on the interface the XDP
//! program runs on, without putting the VIP on the interface: an IPv6 socket
//! per (interface, VIP) with IPV6_ADD_MEMBERSHIP, kept open while the VIP is
//! held. Why a socket rather than adding the MAC to the device (SIOCADDMULTI,
//! RTM_NEWLINK): the kernel then also sends MLD reports, so snooping switches
//! and bridges forward the group to this port, and the membership goes with the
//! descriptor, so a crashed agent leaves no group behind. The kernel neither
//! answers for the VIP (not an address of the interface) nor runs duplicate
//! address detection on it (no address added); the XDP program answers.
use std::{
    collections::BTreeMap,
    io,
    net::Ipv6Addr,
    os::fd::{AsRawFd as _, FromRawFd as _, OwnedFd},
};

/// The solicited-node multicast group of `a` (RFC 4291 2.7.1).
pub fn solicited_node(a: Ipv6Addr) -> Ipv6Addr {
    let o = a.octets();
    Ipv6Addr::from([0xff, 0x02, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 0xff, o[13], o[14], o[15]])
}

/// Joins `group` on `ifindex` for as long as the returned descriptor lives.
pub fn join(ifindex: u32, group: Ipv6Addr) -> io::Result<OwnedFd> {
    // SAFETY: plain syscall; the fd is owned below.
    let fd = unsafe { libc::socket(libc::AF_INET6, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: a fresh fd nobody else owns.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    let mreq = libc::ipv6_mreq { ipv6mr_multiaddr: libc::in6_addr { s6_addr: group.octets() }, ipv6mr_interface: ifindex };
    // SAFETY: valid fd, option value of the stated length.
    let r = unsafe {
        libc::setsockopt(
            fd.as_raw_fd(),
            libc::IPPROTO_IPV6,
            libc::IPV6_ADD_MEMBERSHIP,
            (&mreq as *const libc::ipv6_mreq).cast(),
            std::mem::size_of::<libc::ipv6_mreq>() as libc::socklen_t,
        )
    };
    if r != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(fd)
}

/// The memberships held: (interface, VIP) → the socket that holds its group.
#[derive(Default)]
pub struct Groups {
    joined: BTreeMap<(u32, Ipv6Addr), OwnedFd>,
}

impl Groups {
    /// Joins the groups of `want` not joined yet and leaves the others; the
    /// (interface, VIP, error) of each join that failed (tried again next time).
    pub fn sync(&mut self, want: &std::collections::BTreeSet<(u32, Ipv6Addr)>) -> Vec<(u32, Ipv6Addr, io::Error)> {
        self.joined.retain(|k, _| want.contains(k));
        let mut failed = Vec::new();
        for &(ifindex, vip) in want {
            if self.joined.contains_key(&(ifindex, vip)) {
                continue;
            }
            match join(ifindex, solicited_node(vip)) {
                Ok(fd) => {
                    self.joined.insert((ifindex, vip), fd);
                }
                Err(e) => failed.push((ifindex, vip, e)),
            }
        }
        failed
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn solicited_node_group() {
        let g = solicited_node("2001:2::12:3456".parse().unwrap());
        assert_eq!(g, "ff02::1:ff12:3456".parse::<Ipv6Addr>().unwrap());
    }
}
