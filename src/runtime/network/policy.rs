//! Where a sandbox may connect to: IPv4 CIDRs, the server's allow and deny
//! lists, and the destinations that are refused whatever the lists say.
//!
//! The firewall installs exactly the ordered rules [`DestinationPolicy::rules`]
//! returns, and [`DestinationPolicy::verdict`] walks the same list, so what
//! the unit tests check is what the kernel enforces. First match wins:
//! 1. the link-local range 169.254.0.0/16 (cloud metadata servers: GCE's and
//!    AWS's 169.254.169.254, ECS's 169.254.170.2, …) and the sandbox range
//!    itself (other sandboxes, the host's side of every veth): always denied;
//! 2. the deny list;
//! 3. allow-list entries inside a private range (below): the operator opens
//!    that part of it;
//! 4. the private ranges ([`PRIVATE_RANGES`]: RFC 1918, CGNAT, loopback,
//!    "this network", benchmarking, multicast, reserved): denied by default,
//!    so a sandbox never reaches the company network behind a VPC connector
//!    or the host's own services unless the operator says so;
//! 5. the other allow-list entries (`0.0.0.0/0` is "the internet");
//! 6. with an allow list, everything else is denied; without one, allowed.
//!
//! So `SANDBOXD_NETWORK_ALLOW=0.0.0.0/0,10.20.0.0/16` is "the internet plus
//! that one private network", and an empty allow list is "the internet".
//! IPv6: sandboxes have none (no address on the host side of the veth, no
//! route), so every IPv6 destination, private or not, is unreachable.
//!
//! DNS to the configured nameservers is accepted before all of this (see the
//! firewall), so a nameserver at a link-local address (the metadata server,
//! a node-local cache) keeps working for DNS, and for DNS only.

use std::fmt;
use std::net::Ipv4Addr;
use std::str::FromStr;

/// The cloud metadata server: holds the instance's credentials.
pub const METADATA_ADDRESS: Ipv4Addr = Ipv4Addr::new(169, 254, 169, 254);
/// Link-local IPv4, where clouds put their metadata endpoints (169.254.169.254,
/// ECS's 169.254.170.2, …): always denied.
pub const LINK_LOCAL: Ipv4Cidr = Ipv4Cidr {
    network: Ipv4Addr::new(169, 254, 0, 0),
    prefix: 16,
};

/// Destinations closed by default: private networks (RFC 1918), carrier-grade
/// NAT (RFC 6598, also Tailscale's), loopback and "this network" (which reach
/// the host itself), the IETF protocol block, benchmarking, multicast and the
/// reserved block up to the broadcast address. Link-local is denied always.
pub const PRIVATE_RANGES: [Ipv4Cidr; 10] = [
    cidr_const([0, 0, 0, 0], 8),
    cidr_const([10, 0, 0, 0], 8),
    cidr_const([100, 64, 0, 0], 10),
    cidr_const([127, 0, 0, 0], 8),
    cidr_const([172, 16, 0, 0], 12),
    cidr_const([192, 0, 0, 0], 24),
    cidr_const([192, 168, 0, 0], 16),
    cidr_const([198, 18, 0, 0], 15),
    cidr_const([224, 0, 0, 0], 4),
    cidr_const([240, 0, 0, 0], 4),
];

const fn cidr_const(octets: [u8; 4], prefix: u8) -> Ipv4Cidr {
    Ipv4Cidr {
        network: Ipv4Addr::new(octets[0], octets[1], octets[2], octets[3]),
        prefix,
    }
}

/// An IPv4 network: `10.0.0.0/8`, or a single address (`/32`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Ipv4Cidr {
    network: Ipv4Addr,
    prefix: u8,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PolicyError {
    #[error("invalid IPv4 CIDR {0:?}: expected a.b.c.d/n with n from 0 to 32, or a.b.c.d")]
    InvalidCidr(String),
    #[error("{0} has host bits set; did you mean {1}?")]
    HostBits(String, Ipv4Cidr),
}

impl Ipv4Cidr {
    pub fn new(network: Ipv4Addr, prefix: u8) -> Option<Self> {
        (prefix <= 32 && u32::from(network) & !mask(prefix) == 0)
            .then_some(Self { network, prefix })
    }

    pub fn host(address: Ipv4Addr) -> Self {
        Self {
            network: address,
            prefix: 32,
        }
    }

    pub fn network(&self) -> Ipv4Addr {
        self.network
    }

    pub fn prefix(&self) -> u8 {
        self.prefix
    }

    pub fn contains(&self, address: Ipv4Addr) -> bool {
        u32::from(address) & mask(self.prefix) == u32::from(self.network)
    }

    /// Whether `other` lies entirely inside this network.
    pub fn covers(&self, other: &Ipv4Cidr) -> bool {
        other.prefix >= self.prefix && self.contains(other.network)
    }

    /// How many addresses the network spans.
    pub fn size(&self) -> u64 {
        1u64 << (32 - u32::from(self.prefix))
    }
}

fn mask(prefix: u8) -> u32 {
    match prefix {
        0 => 0,
        p => u32::MAX << (32 - u32::from(p.min(32))),
    }
}

impl fmt::Display for Ipv4Cidr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.network, self.prefix)
    }
}

impl FromStr for Ipv4Cidr {
    type Err = PolicyError;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        let invalid = || PolicyError::InvalidCidr(text.to_owned());
        let text = text.trim();
        let (address, prefix) = match text.split_once('/') {
            Some((address, prefix)) => {
                let prefix: u8 = prefix.parse().map_err(|_| invalid())?;
                (address, prefix)
            }
            None => (text, 32),
        };
        let address: Ipv4Addr = address.parse().map_err(|_| invalid())?;
        if prefix > 32 {
            return Err(invalid());
        }
        let network = Ipv4Addr::from(u32::from(address) & mask(prefix));
        if network != address {
            return Err(PolicyError::HostBits(
                text.to_owned(),
                Self { network, prefix },
            ));
        }
        Ok(Self { network, prefix })
    }
}

/// Parses a comma-separated CIDR list (empty: none).
pub fn parse_cidr_list(text: &str) -> Result<Vec<Ipv4Cidr>, PolicyError> {
    text.split(',')
        .map(str::trim)
        .filter(|item| !item.is_empty())
        .map(str::parse)
        .collect()
}

/// What happens to a connection attempt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    Accept,
    Drop,
}

/// The destinations sandboxes may reach.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DestinationPolicy {
    /// The sandbox address range: never a destination.
    pub sandbox_range: Ipv4Cidr,
    /// Only these (if any are given).
    pub allow: Vec<Ipv4Cidr>,
    /// Never these (wins over `allow`).
    pub deny: Vec<Ipv4Cidr>,
}

impl DestinationPolicy {
    /// The ordered rules, first match wins, and the verdict when none matches.
    pub fn rules(&self) -> (Vec<(Ipv4Cidr, Verdict)>, Verdict) {
        let mut rules = vec![
            (LINK_LOCAL, Verdict::Drop),
            (self.sandbox_range, Verdict::Drop),
        ];
        rules.extend(self.deny.iter().map(|cidr| (*cidr, Verdict::Drop)));
        let private = |cidr: &Ipv4Cidr| PRIVATE_RANGES.iter().any(|range| range.covers(cidr));
        rules.extend(
            self.allow
                .iter()
                .filter(|cidr| private(cidr))
                .map(|cidr| (*cidr, Verdict::Accept)),
        );
        rules.extend(PRIVATE_RANGES.iter().map(|cidr| (*cidr, Verdict::Drop)));
        rules.extend(
            self.allow
                .iter()
                .filter(|cidr| !private(cidr))
                .map(|cidr| (*cidr, Verdict::Accept)),
        );
        let fallback = if self.allow.is_empty() {
            Verdict::Accept
        } else {
            Verdict::Drop
        };
        (rules, fallback)
    }

    /// The verdict for a destination, as the firewall rules decide it.
    pub fn verdict(&self, destination: Ipv4Addr) -> Verdict {
        let (rules, fallback) = self.rules();
        rules
            .iter()
            .find(|(cidr, _)| cidr.contains(destination))
            .map_or(fallback, |(_, verdict)| *verdict)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cidr(text: &str) -> Ipv4Cidr {
        text.parse().expect("valid CIDR")
    }

    fn ip(text: &str) -> Ipv4Addr {
        text.parse().expect("valid address")
    }

    #[test]
    fn cidrs_parse_and_match() {
        assert_eq!(cidr("10.0.0.0/8").to_string(), "10.0.0.0/8");
        assert_eq!(cidr("192.0.2.7").to_string(), "192.0.2.7/32");
        assert_eq!(cidr("0.0.0.0/0").size(), 1 << 32);
        assert!(cidr("0.0.0.0/0").contains(ip("203.0.113.9")));
        assert!(cidr("10.231.0.0/16").contains(ip("10.231.255.255")));
        assert!(!cidr("10.231.0.0/16").contains(ip("10.232.0.0")));
        for bad in [
            "10.0.0.0/33",
            "10.0.0/8",
            "ten/8",
            "",
            "10.0.0.0/-1",
            "::1/128",
        ] {
            assert!(bad.parse::<Ipv4Cidr>().is_err(), "{bad:?}");
        }
        let err = "10.0.0.1/8".parse::<Ipv4Cidr>().unwrap_err();
        assert!(err.to_string().contains("10.0.0.0/8"), "{err}");
        assert_eq!(
            parse_cidr_list(" 10.0.0.0/8, ,192.0.2.1 ").unwrap(),
            vec![cidr("10.0.0.0/8"), cidr("192.0.2.1/32")]
        );
        assert!(parse_cidr_list("10.0.0.0/8,nope").is_err());
        assert_eq!(parse_cidr_list("").unwrap(), vec![]);
    }

    fn policy(allow: &str, deny: &str) -> DestinationPolicy {
        DestinationPolicy {
            sandbox_range: cidr("10.231.0.0/16"),
            allow: parse_cidr_list(allow).unwrap(),
            deny: parse_cidr_list(deny).unwrap(),
        }
    }

    #[test]
    fn without_lists_everything_but_link_local_private_ranges_and_sandboxes_is_allowed() {
        let open = policy("", "");
        assert_eq!(open.verdict(ip("198.51.100.2")), Verdict::Accept);
        assert_eq!(open.verdict(ip("8.8.8.8")), Verdict::Accept);
        for private in [
            "10.0.0.1",
            "10.255.255.255",
            "172.16.0.1",
            "172.31.255.254",
            "192.168.1.1",
            "100.64.0.1",
            "100.127.255.255",
            "127.0.0.1",
            "0.0.0.0",
            "192.0.0.8",
            "198.18.0.1",
            "224.0.0.251",
            "255.255.255.255",
        ] {
            assert_eq!(open.verdict(ip(private)), Verdict::Drop, "{private}");
        }
        for public in [
            "172.32.0.1",
            "100.128.0.1",
            "192.169.0.1",
            "11.0.0.1",
            "9.255.255.255",
        ] {
            assert_eq!(open.verdict(ip(public)), Verdict::Accept, "{public}");
        }
        assert_eq!(open.verdict(METADATA_ADDRESS), Verdict::Drop);
        assert_eq!(open.verdict(ip("169.254.170.2")), Verdict::Drop);
        assert_eq!(open.verdict(ip("169.254.0.1")), Verdict::Drop);
        assert_eq!(open.verdict(ip("169.255.0.1")), Verdict::Accept);
        assert_eq!(open.verdict(ip("10.231.0.6")), Verdict::Drop);
    }

    #[test]
    fn deny_wins_over_allow_and_an_allow_list_closes_the_rest() {
        let p = policy("198.51.100.0/24,169.254.0.0/16", "198.51.100.128/25");
        assert_eq!(p.verdict(ip("198.51.100.2")), Verdict::Accept);
        assert_eq!(p.verdict(ip("198.51.100.200")), Verdict::Drop);
        assert_eq!(p.verdict(ip("203.0.113.1")), Verdict::Drop);
        // Allowing the link-local range opens none of it.
        assert_eq!(p.verdict(METADATA_ADDRESS), Verdict::Drop);
        assert_eq!(p.verdict(ip("169.254.1.1")), Verdict::Drop);
        let denied = policy("", "203.0.113.0/24");
        assert_eq!(denied.verdict(ip("203.0.113.5")), Verdict::Drop);
        assert_eq!(denied.verdict(ip("8.8.8.8")), Verdict::Accept);
    }

    #[test]
    fn the_allow_list_opens_exactly_the_private_part_it_names() {
        // Only a private network.
        let internal = policy("10.20.0.0/16", "");
        assert_eq!(internal.verdict(ip("10.20.3.4")), Verdict::Accept);
        assert_eq!(internal.verdict(ip("10.21.0.1")), Verdict::Drop);
        assert_eq!(internal.verdict(ip("8.8.8.8")), Verdict::Drop);
        // The internet plus one private network.
        let both = policy("0.0.0.0/0,10.20.0.0/16", "");
        assert_eq!(both.verdict(ip("8.8.8.8")), Verdict::Accept);
        assert_eq!(both.verdict(ip("10.20.3.4")), Verdict::Accept);
        assert_eq!(both.verdict(ip("10.21.0.1")), Verdict::Drop);
        assert_eq!(both.verdict(ip("192.168.0.1")), Verdict::Drop);
        // 0.0.0.0/0 alone, or an entry wider than a private range, opens none of it.
        let internet = policy("0.0.0.0/0,8.0.0.0/6", "");
        assert_eq!(internet.verdict(ip("8.8.8.8")), Verdict::Accept);
        assert_eq!(internet.verdict(ip("10.0.0.1")), Verdict::Drop);
        assert_eq!(internet.verdict(ip("127.0.0.1")), Verdict::Drop);
        // The deny list still wins; the sandbox range stays closed when allowed.
        let carved = policy("10.0.0.0/8", "10.20.0.0/16");
        assert_eq!(carved.verdict(ip("10.20.0.1")), Verdict::Drop);
        assert_eq!(carved.verdict(ip("10.1.0.1")), Verdict::Accept);
        assert_eq!(carved.verdict(ip("10.231.0.6")), Verdict::Drop);
        assert!(cidr("10.0.0.0/8").covers(&cidr("10.20.0.0/16")));
        assert!(!cidr("10.20.0.0/16").covers(&cidr("10.0.0.0/8")));
    }
}
