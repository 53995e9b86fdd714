//! A sandbox's network mode: recorded in its spec (chosen at create) and in
//! every checkpoint manifest, so whichever host restores it sets the same kind
//! of network up again (with a fresh address: addresses belong to hosts).

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

/// How a sandbox reaches the network.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum NetworkMode {
    /// Loopback only (the default, and all that documents written before
    /// network modes existed mean).
    #[default]
    None,
    /// Outbound connections through a network namespace of its own, NATed to
    /// the host's route, under the server's destination policy.
    Egress,
}

impl NetworkMode {
    pub const ALL: [NetworkMode; 2] = [NetworkMode::None, NetworkMode::Egress];

    pub fn as_str(self) -> &'static str {
        match self {
            Self::None => "none",
            Self::Egress => "egress",
        }
    }

    /// True for [`NetworkMode::None`] (serde's `skip_serializing_if`).
    pub fn is_none(&self) -> bool {
        *self == Self::None
    }
}

impl fmt::Display for NetworkMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// An unknown network mode name.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown network mode {0:?}; expected none or egress")]
pub struct UnknownNetworkMode(pub String);

impl FromStr for NetworkMode {
    type Err = UnknownNetworkMode;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        Self::ALL
            .into_iter()
            .find(|mode| mode.as_str() == text)
            .ok_or_else(|| UnknownNetworkMode(text.to_owned()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_and_unknown_names_are_refused() {
        for mode in NetworkMode::ALL {
            assert_eq!(mode.as_str().parse::<NetworkMode>(), Ok(mode));
            assert_eq!(
                serde_json::to_string(&mode).ok(),
                Some(format!("\"{mode}\""))
            );
        }
        assert!("bridge".parse::<NetworkMode>().is_err());
        assert_eq!(NetworkMode::default(), NetworkMode::None);
    }
}
