//! The kernel sandboxes of [`crate::netns`] do what other tests rely on: they isolate,
//! connect, and leave nothing behind (also after a panic).

use std::net::UdpSocket;
use std::os::unix::fs::MetadataExt as _;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::Mutex;
use std::time::Duration;

use crate::netns::{Bpffs, Netns, TestCgroup, Veth, VethEnd, require_root};

const BPF_FS_MAGIC: i64 = 0xcafe4a11;

#[test]
fn namespaces_and_veths_are_removed_on_drop_even_when_the_test_panics() {
    if !require_root() {
        return;
    }
    let created: Mutex<Option<(PathBuf, String)>> = Mutex::new(None);
    let result = std::panic::catch_unwind(|| {
        let a = Netns::new("nssup-panic-a").unwrap();
        let b = Netns::new("nssup-panic-b").unwrap();
        let _veth = Veth::create(VethEnd::new(&a, "va"), VethEnd::new(&b, "vb")).unwrap();
        *created.lock().unwrap() = Some((a.path(), b.name().to_string()));
        panic!("test failure inside the sandbox");
    });
    assert!(result.is_err());
    let (a_path, b_name) = created.lock().unwrap().take().expect("sandbox was created");
    assert!(!a_path.exists(), "{} left behind", a_path.display());
    let list = std::process::Command::new("ip")
        .args(["netns", "list"])
        .output()
        .unwrap();
    assert!(
        !String::from_utf8_lossy(&list.stdout).contains(&b_name),
        "{b_name} left behind"
    );
}

#[test]
fn run_and_command_execute_inside_the_namespace_only() {
    if !require_root() {
        return;
    }
    let ns = Netns::new("nssup-run").unwrap();
    let ns_inode = std::fs::metadata(ns.path()).unwrap().ino();
    let own_inode = |p: &str| std::fs::metadata(p).unwrap().ino();
    let inside = ns.run(|| own_inode("/proc/thread-self/ns/net")).unwrap();
    assert_eq!(inside, ns_inode);
    assert_ne!(
        own_inode("/proc/thread-self/ns/net"),
        ns_inode,
        "the caller stayed outside"
    );

    // A command sees the namespace's interfaces only (lo, up) and the host's mounts.
    let links = ns.exec("ip", &["-o", "link", "show"]).unwrap();
    assert_eq!(links.lines().count(), 1, "{links}");
    assert!(links.contains("lo:") && links.contains("UP"), "{links}");
    let cmd_inode = ns
        .exec("stat", &["-L", "-c", "%i", "/proc/self/ns/net"])
        .unwrap();
    assert_eq!(cmd_inode.trim().parse::<u64>().unwrap(), ns_inode);

    let panicked = std::panic::catch_unwind(|| ns.run(|| panic!("inside")));
    assert!(panicked.is_err(), "a panic inside run reaches the caller");
}

#[test]
fn veth_connects_two_namespaces_with_addresses_and_routes() {
    if !require_root() {
        return;
    }
    let node = Netns::new("nssup-veth-node").unwrap();
    let pod = Netns::new("nssup-veth-pod").unwrap();
    let _veth = Veth::create(
        VethEnd::new(&node, "vpod").addr("10.202.0.1/24"),
        VethEnd::new(&pod, "eth0").addr("10.202.0.2/24"),
    )
    .unwrap();
    // A route through the veth to a prefix that is not directly connected.
    pod.add_route("10.203.0.0/16", "10.202.0.1").unwrap();
    let routes = pod.ip(&["route", "show"]).unwrap();
    assert!(
        routes.contains("10.203.0.0/16 via 10.202.0.1 dev eth0"),
        "{routes}"
    );

    let server = node
        .run(|| UdpSocket::bind("10.202.0.1:9000"))
        .unwrap()
        .unwrap();
    server
        .set_read_timeout(Some(Duration::from_secs(5)))
        .unwrap();
    let client = pod
        .run(|| UdpSocket::bind("10.202.0.2:0"))
        .unwrap()
        .unwrap();
    client.send_to(b"hello", "10.202.0.1:9000").unwrap();
    let mut buf = [0u8; 16];
    let (n, from) = server.recv_from(&mut buf).unwrap();
    assert_eq!(&buf[..n], b"hello");
    assert_eq!(from.ip().to_string(), "10.202.0.2");
    assert!(
        Veth::create(
            VethEnd::new(&node, "a-name-too-long-1"),
            VethEnd::new(&pod, "x")
        )
        .is_err()
    );
}

#[test]
fn bpffs_is_a_private_mount_removed_on_drop() {
    if !require_root() {
        return;
    }
    let fs = Bpffs::new("nssup-bpffs").unwrap();
    let dir = fs.path().to_path_buf();
    let stat = nix::sys::statfs::statfs(&dir).unwrap();
    assert_eq!(stat.filesystem_type().0 as i64, BPF_FS_MAGIC);
    assert_eq!(fs.entries().unwrap(), Vec::<String>::new(), "fresh bpffs");
    std::fs::create_dir(dir.join("kproxy")).unwrap();
    assert_eq!(fs.entries().unwrap(), vec!["kproxy".to_string()]);
    drop(fs);
    assert!(!dir.exists(), "{} left behind", dir.display());
}

#[test]
fn test_cgroup_holds_spawned_commands_and_is_removed_with_them() {
    if !require_root() {
        return;
    }
    let ns = Netns::new("nssup-cg").unwrap();
    let cgroup = TestCgroup::new("nssup-cg").unwrap();
    let path = cgroup.path().to_path_buf();
    assert!(path.join("cgroup.procs").exists());
    let mut cmd = ns.command("sleep");
    cmd.arg("60").stdin(Stdio::null());
    cgroup.enter_on_spawn(&mut cmd).unwrap();
    let mut child = cmd.spawn().unwrap();
    // nsenter execs `sleep` in the same process, so the pid is the child's.
    assert_eq!(cgroup.procs().unwrap(), vec![child.id()]);
    let membership = std::fs::read_to_string(format!("/proc/{}/cgroup", child.id())).unwrap();
    let name = path.file_name().unwrap().to_string_lossy().into_owned();
    assert!(
        membership
            .lines()
            .any(|l| l.starts_with("0::") && l.ends_with(&name)),
        "{membership}"
    );

    drop(cgroup);
    let status = child.wait().unwrap();
    assert!(
        !status.success(),
        "the process was killed with its cgroup: {status}"
    );
    assert!(!Path::new(&path).exists(), "{} left behind", path.display());
}
