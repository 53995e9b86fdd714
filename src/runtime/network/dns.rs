//! DNS for sandboxes: the nameservers they use and the `resolv.conf` that is
//! bind-mounted over theirs.
//!
//! The default is the host's own nameservers, minus loopback ones (a resolver
//! on the host's 127.0.0.53 is not reachable from a sandbox, and must not be:
//! the host's services are off limits). On Cloud Run and GCE that is
//! 169.254.169.254, the metadata server, which also serves DNS: the firewall
//! lets port 53 through to configured nameservers before it drops the rest of
//! the link-local range.

use std::net::Ipv4Addr;

/// The IPv4 `nameserver` lines of a `resolv.conf`, loopback ones left out.
pub fn nameservers_from_resolv_conf(text: &str) -> Vec<Ipv4Addr> {
    text.lines()
        .filter_map(|line| {
            let mut words = line.split_whitespace();
            (words.next() == Some("nameserver")).then(|| words.next())?
        })
        .filter_map(|address| address.parse::<Ipv4Addr>().ok())
        .filter(|address| !address.is_loopback())
        .collect()
}

/// The host's nameservers (`/etc/resolv.conf`).
pub fn host_nameservers() -> Vec<Ipv4Addr> {
    std::fs::read_to_string("/etc/resolv.conf")
        .map(|text| nameservers_from_resolv_conf(&text))
        .unwrap_or_default()
}

/// The sandbox's `/etc/resolv.conf`.
pub fn resolv_conf(nameservers: &[Ipv4Addr]) -> String {
    let mut text = String::from("# written by sandboxd for this sandbox\n");
    for server in nameservers {
        text.push_str(&format!("nameserver {server}\n"));
    }
    text.push_str("options timeout:2 attempts:2\n");
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loopback_and_ipv6_nameservers_are_left_out() {
        let text = "# comment\nnameserver 127.0.0.53\nnameserver 10.255.255.53\nnameserver ::1\nsearch x\nnameserver 169.254.169.254\n";
        assert_eq!(
            nameservers_from_resolv_conf(text),
            vec![
                Ipv4Addr::new(10, 255, 255, 53),
                Ipv4Addr::new(169, 254, 169, 254)
            ]
        );
        let conf = resolv_conf(&[Ipv4Addr::new(10, 0, 0, 2)]);
        assert!(conf.contains("nameserver 10.0.0.2\n"), "{conf}");
    }
}
