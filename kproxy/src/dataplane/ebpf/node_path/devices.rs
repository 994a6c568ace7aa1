//! Which devices get the TC programs.
//!
//! `--bpf-devices eth0,eth1` names them explicitly (each must exist). Without it, the default
//! is every device that is up, is not a loopback, and holds a *node address*: a global-scope
//! IPv4 or IPv6 address (not loopback, link-local or multicast). On a Kubernetes node that is
//! the uplink(s) carrying NodePort traffic and the routes to other nodes; pod veths (which a
//! CNI leaves without a global address) are not selected, a CNI bridge holding the pods'
//! gateway address is (which lets pods reach NodePorts through it). A device that carries
//! routes to other nodes but holds no address of its own must be named explicitly.
//!
//! Pure: [`select`] works on [`Interface`] values, read from the kernel by
//! [`crate::kernel::addresses::scan`].

use std::collections::BTreeSet;

use crate::kernel::addresses::Interface;

/// Errors of device selection.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DeviceError {
    #[error("--bpf-devices: no device named {0:?} on this node")]
    Unknown(String),
    #[error("--bpf-devices: {0:?} is a loopback device; TC programs belong on node devices")]
    Loopback(String),
    #[error("--bpf-devices: empty device name in the list")]
    Empty,
}

/// The devices to attach to, sorted and unique: `explicit` (from `--bpf-devices`) when given,
/// else the default rule of the module docs.
pub fn select(
    explicit: Option<&[String]>,
    interfaces: &[Interface],
) -> Result<Vec<String>, DeviceError> {
    let mut out = BTreeSet::new();
    match explicit {
        Some(names) => {
            for name in names {
                if name.is_empty() {
                    return Err(DeviceError::Empty);
                }
                let iface = interfaces
                    .iter()
                    .find(|i| &i.name == name)
                    .ok_or_else(|| DeviceError::Unknown(name.clone()))?;
                if iface.loopback {
                    return Err(DeviceError::Loopback(name.clone()));
                }
                out.insert(name.clone());
            }
        }
        None => {
            for iface in interfaces {
                if iface.up && !iface.loopback && iface.node_addrs().next().is_some() {
                    out.insert(iface.name.clone());
                }
            }
        }
    }
    Ok(out.into_iter().collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::kernel::addresses::tests::iface;

    fn node() -> Vec<Interface> {
        vec![
            iface("lo", 1, &["127.0.0.1", "::1"]),
            iface("eth0", 2, &["192.0.2.10", "fe80::1"]),
            iface("eth1", 3, &["2001:db8::10", "fe80::2"]),
            iface("veth1234", 4, &["fe80::3"]),
            iface("cni0", 5, &["10.244.0.1"]),
            Interface {
                up: false,
                ..iface("eth2", 6, &["198.51.100.1"])
            },
        ]
    }

    #[test]
    fn default_picks_up_devices_with_a_global_address() {
        assert_eq!(
            select(None, &node()).unwrap(),
            vec!["cni0", "eth0", "eth1"],
            "not lo, not the link-local-only veth, not the down eth2"
        );
    }

    #[test]
    fn explicit_list_is_taken_as_given_and_checked() {
        let names = vec!["veth1234".to_string(), "eth0".into(), "eth0".into()];
        assert_eq!(
            select(Some(&names), &node()).unwrap(),
            vec!["eth0", "veth1234"]
        );
        let err = select(Some(&["eth9".to_string()]), &node()).unwrap_err();
        assert_eq!(err, DeviceError::Unknown("eth9".into()));
        assert!(err.to_string().contains("eth9"), "{err}");
        assert_eq!(
            select(Some(&["lo".to_string()]), &node()).unwrap_err(),
            DeviceError::Loopback("lo".into())
        );
        assert_eq!(
            select(Some(&[String::new()]), &node()).unwrap_err(),
            DeviceError::Empty
        );
    }
}
