//! Backend MACs the config leaves out, read from the kernel's neighbour table.
use std::net::{Ipv4Addr, UdpSocket};

/// ATF_COM: the entry is complete (resolved), not incomplete or failed.
const ATF_COM: u32 = 0x2;

/// Parses /proc/net/arp text: "IP address  HW type  Flags  HW address  Mask  Device".
pub fn parse_proc_arp(text: &str, addr: Ipv4Addr) -> Option<[u8; 6]> {
    text.lines().skip(1).find_map(|l| {
        let f: Vec<&str> = l.split_whitespace().collect();
        if f.len() < 4 || f[0].parse::<Ipv4Addr>().ok()? != addr {
            return None;
        }
        let flags = u32::from_str_radix(f[2].trim_start_matches("0x"), 16).ok()?;
        if flags & ATF_COM == 0 {
            return None;
        }
        let mac: Vec<u8> = f[3].split(':').filter_map(|b| u8::from_str_radix(b, 16).ok()).collect();
        let mac: [u8; 6] = mac.try_into().ok()?;
        (mac != [0; 6]).then_some(mac)
    })
}

/// This network namespace's IPv4 neighbour table as /proc/net/arp shows it (empty
/// when unreadable); look addresses up in it with `parse_proc_arp`.
pub fn table() -> String {
    std::fs::read_to_string("/proc/net/arp").unwrap_or_default()
}

/// Makes the kernel resolve `addr`: one UDP datagram to the discard port. The
/// health probes do the same for checked backends; this covers unchecked ones.
pub fn solicit(addr: Ipv4Addr) {
    if let Ok(s) = UdpSocket::bind("0.0.0.0:0") {
        let _ = s.send_to(&[], (addr, 9));
    }
}

#[cfg(test)]
mod tests {
    use super::parse_proc_arp;

    const TABLE: &str = "IP address       HW type     Flags       HW address            Mask     Device\n\
        198.18.0.12      0x1         0x2         02:00:00:00:00:12     *        eth0\n\
        198.18.0.13      0x1         0x0         00:00:00:00:00:00     *        eth0\n";

    #[test]
    fn reads_complete_entries_only() {
        assert_eq!(parse_proc_arp(TABLE, "198.18.0.12".parse().unwrap()), Some([2, 0, 0, 0, 0, 0x12]));
        assert_eq!(parse_proc_arp(TABLE, "198.18.0.13".parse().unwrap()), None, "incomplete entry");
        assert_eq!(parse_proc_arp(TABLE, "198.18.0.14".parse().unwrap()), None, "absent");
    }
}
