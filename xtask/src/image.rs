//! `cargo xtask image [--profile dev] [--rootfs DIR]`: builds the kproxy container image
//! without pulling any base image, from Debian's packages and the release binary. Needs root
//! (mmdebstrap's root mode); installs what it lacks through [`crate::setup`].
//!
//! 1. `cargo build --release --locked -p kproxy --bin kproxy` (`--profile dev`: the dev build,
//!    into [`Profile::Dev`]'s archive; what `cargo xtask test` runs, see [`Profile`]).
//! 2. The root filesystem: `mmdebstrap --variant=extract` unpacks the packages of
//!    [`PACKAGES_FILE`] and the libraries they depend on (apt resolves them) from Debian 12 and
//!    its updates and security archives ([`SOURCES`]). `extract` only unpacks: no maintainer
//!    script runs, so the image needs (and has) no shell, dpkg or apt. Packages marked
//!    `files-only` there (ca-certificates) are downloaded from the same package lists without
//!    their dependencies and unpacked with `dpkg-deb`. Then [`finish_rootfs`]:
//!    `/var/lib/dpkg/status` written from the unpacked packages' control files (what image
//!    scanners read), what maintainer scripts would have set up and a container uses done by
//!    hand (`/etc/nsswitch.conf`, `/var/run` → `/run`, the CA bundle
//!    `/etc/ssl/certs/ca-certificates.crt`), and what a container does not use
//!    removed: `/dev` nodes, the host's `/etc/resolv.conf` and `/etc/hostname`, mmdebstrap's
//!    `/etc/fstab`, apt's and dpkg's state, manual pages and documentation other than the
//!    copyright files.
//! 3. Two layers, each a tar made reproducible (GNU tar: names sorted, owners 0, mtimes clamped
//!    to `SOURCE_DATE_EPOCH`, pax without atime/ctime) and `gzip -n`: the Debian root
//!    filesystem, then `/usr/local/bin/kproxy` (a new kproxy version reuses the first layer).
//! 4. An OCI image: config (entrypoint, `PATH`, labels: title, description, version, revision,
//!    source, licenses, created), manifest, `index.json` naming it
//!    `docker.io/library/kproxy:latest` (what the manifests' `image: kproxy:latest` means),
//!    written as one tar, [`Profile::archive`] under the target directory, that is both an OCI image
//!    layout and a `docker save` archive (a `manifest.json` beside `index.json`, as
//!    `docker save` writes since Docker 25): `podman load -i`, `docker load -i` and
//!    `kind load image-archive` take it.
//!
//! `SOURCE_DATE_EPOCH` (from the environment, else the commit's time) is every timestamp, so
//! two builds of one commit give the same digest — from the same Debian archive state: a
//! security update of one of the packages changes the first layer, which is the point of
//! rebuilding. The revision label is the commit (`-dirty` with uncommitted changes).
//!
//! `--rootfs DIR` stops after step 2 with the binary in `DIR/usr/local/bin/`: the files of the
//! image, which deploy/Dockerfile copies into a `FROM scratch` image.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode};

use anyhow::{Context as _, bail};
use serde_json::{Value, json};

use crate::process::{display, is_root, output, run_step};

/// The Debian packages of the image (shared with deploy/Dockerfile), relative to the
/// workspace root.
pub const PACKAGES_FILE: &str = "deploy/image/packages.txt";
/// Which build of the binary goes into the image.
///
/// `cargo xtask test` builds the image with [`Profile::Dev`]: the suite has just built that
/// binary, while a cold release build costs ≈ 20 min on a 2-core machine (measured here,
/// under other builds' load), which would double the suite's time. The image's files, layers,
/// labels and the podman runs are the same; only the binary's optimisation differs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Profile {
    Release,
    Dev,
}

impl Profile {
    /// The archive, relative to the target directory (`tests/src/podman.rs` finds it there).
    pub fn archive(self) -> &'static str {
        match self {
            Profile::Release => "image/kproxy-image.tar",
            Profile::Dev => "image/kproxy-image-dev.tar",
        }
    }

    /// cargo's arguments selecting the profile, and its output directory.
    fn cargo(self) -> (&'static [&'static str], &'static str) {
        match self {
            Profile::Release => (&["--release"], "release"),
            Profile::Dev => (&[], "debug"),
        }
    }
}
/// The Debian release the root filesystem comes from (the build machine's, so the binary's
/// glibc matches).
pub const SUITE: &str = "bookworm";
/// Its archives: the release, its updates and its security updates.
pub const SOURCES: &[&str] = &[
    "deb http://deb.debian.org/debian bookworm main",
    "deb http://deb.debian.org/debian bookworm-updates main",
    "deb http://deb.debian.org/debian-security bookworm-security main",
];
/// The name the archive gives the image: `kproxy:latest` as Docker and containerd normalize it.
pub const IMAGE_NAME: &str = "docker.io/library/kproxy:latest";
/// Where the binary goes, and the image's entrypoint.
pub const BINARY_PATH: &str = "usr/local/bin/kproxy";
/// The image's `PATH` (the agent runs iptables, ipset and nft by name).
pub const PATH_ENV: &str = "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

/// `/etc/nsswitch.conf` (libc-bin's postinst writes Debian's; libc-bin is not in the image):
/// without one glibc asks DNS before `/etc/hosts`.
const NSSWITCH: &str = "# The kproxy image (xtask/src/image.rs): Debian's order.\n\
passwd: files\ngroup: files\nshadow: files\nhosts: files dns\nnetworks: files\n\
protocols: files\nservices: files\n";

const OCI_MANIFEST: &str = "application/vnd.oci.image.manifest.v1+json";
const OCI_CONFIG: &str = "application/vnd.oci.image.config.v1+json";
const OCI_LAYER_GZIP: &str = "application/vnd.oci.image.layer.v1.tar+gzip";
const OCI_INDEX: &str = "application/vnd.oci.image.index.v1+json";

/// `cargo xtask image [--profile dev|release] [--rootfs DIR]`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// Which build of the binary: `dev` (what `cargo xtask test` runs) goes into
    /// target/image/kproxy-image-dev.tar.
    #[arg(long, value_enum, default_value_t = Profile::Release)]
    pub profile: Profile,
    /// Only the image's files, into DIR (what deploy/Dockerfile copies).
    #[arg(long, value_name = "DIR")]
    pub rootfs: Option<PathBuf>,
}

pub fn run(args: &Args) -> anyhow::Result<ExitCode> {
    let (profile, rootfs) = (args.profile, args.rootfs.clone());
    crate::setup::run()?;
    match rootfs {
        Some(dir) => {
            build_rootfs_with_binary(&dir, profile)?;
            println!("image: the image's files are in {}", dir.display());
        }
        None => {
            build(profile)?;
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// What [`build`] made.
#[derive(Debug, Clone)]
pub struct Built {
    pub archive: PathBuf,
    /// `sha256:…` of the OCI manifest (what a registry and `podman images --digests` show).
    pub digest: String,
    /// `sha256:…` of the config (the image ID).
    pub id: String,
    /// Config and compressed layers: what a node downloads.
    pub compressed_size: u64,
}

/// The whole image: the binary's build, root filesystem, layers, [`Profile::archive`].
pub fn build(profile: Profile) -> anyhow::Result<Built> {
    require_root()?;
    let root = crate::workspace_root();
    let target = crate::target_dir();
    let meta = Metadata::read(&root)?;
    let binary = build_binary(&root, &target, profile)?;
    let work = target.join("image/build");
    remove_dir_if_exists(&work)?;
    std::fs::create_dir_all(&work).with_context(|| format!("creating {}", work.display()))?;

    let rootfs = work.join("rootfs");
    let packages = build_rootfs(&root, &rootfs, meta.epoch)?;
    let bin_layer = work.join("kproxy-layer");
    install_binary(&binary, &bin_layer)?;

    let oci = work.join("oci");
    let blobs = oci.join("blobs/sha256");
    std::fs::create_dir_all(&blobs)?;
    let mut layers = vec![];
    for (dir, name) in [(&rootfs, "rootfs"), (&bin_layer, "kproxy")] {
        layers.push(make_layer(dir, &work.join(name), &blobs, meta.epoch)?);
    }

    let created = rfc3339(meta.epoch);
    let package_list = packages
        .iter()
        .map(|(p, v)| format!("{p} {v}"))
        .collect::<Vec<_>>()
        .join(", ");
    let config = json!({
        "architecture": "amd64",
        "os": "linux",
        "created": created,
        "config": {
            "Entrypoint": [format!("/{BINARY_PATH}")],
            "Env": [PATH_ENV],
            "WorkingDir": "/",
            "Labels": meta.labels(&created),
        },
        "rootfs": {
            "type": "layers",
            "diff_ids": layers.iter().map(|l| l.diff_id.clone()).collect::<Vec<_>>(),
        },
        "history": [
            {
                "created": created,
                "created_by": format!("mmdebstrap --variant=extract {SUITE} ({PACKAGES_FILE})"),
                "comment": format!("Debian packages: {package_list}"),
            },
            {
                "created": created,
                "created_by": format!(
                    "cargo build {}-p kproxy; /{BINARY_PATH}",
                    profile.cargo().0.iter().map(|a| format!("{a} ")).collect::<String>()
                ),
            },
        ],
    });
    let config = write_blob(&blobs, &to_json(&config))?;
    let manifest = json!({
        "schemaVersion": 2,
        "mediaType": OCI_MANIFEST,
        "config": {"mediaType": OCI_CONFIG, "digest": config.digest, "size": config.size},
        "layers": layers.iter().map(|l| json!({
            "mediaType": OCI_LAYER_GZIP, "digest": l.blob.digest, "size": l.blob.size,
        })).collect::<Vec<_>>(),
    });
    let manifest = write_blob(&blobs, &to_json(&manifest))?;
    let index = json!({
        "schemaVersion": 2,
        "mediaType": OCI_INDEX,
        "manifests": [{
            "mediaType": OCI_MANIFEST,
            "digest": manifest.digest,
            "size": manifest.size,
            "annotations": {
                "io.containerd.image.name": IMAGE_NAME,
                "org.opencontainers.image.ref.name": "latest",
            },
        }],
    });
    std::fs::write(oci.join("index.json"), to_json(&index))?;
    std::fs::write(oci.join("oci-layout"), r#"{"imageLayoutVersion":"1.0.0"}"#)?;
    // `docker save`'s manifest (Docker < 25 loads only this one; newer ones and podman read
    // index.json). Repository tags in Docker's short form.
    let docker = json!([{
        "Config": blob_path(&config.digest),
        "RepoTags": ["kproxy:latest"],
        "Layers": layers.iter().map(|l| blob_path(&l.blob.digest)).collect::<Vec<_>>(),
    }]);
    std::fs::write(oci.join("manifest.json"), to_json(&docker))?;

    let archive = target.join(profile.archive());
    let partial = archive.with_extension("tar.partial");
    reproducible_tar(
        &oci,
        &["blobs", "index.json", "manifest.json", "oci-layout"],
        &partial,
        meta.epoch,
    )?;
    std::fs::rename(&partial, &archive)?;
    remove_dir_if_exists(&work)?;

    let compressed_size = config.size + layers.iter().map(|l| l.blob.size).sum::<u64>();
    let unpacked: u64 = layers.iter().map(|l| l.tar_size).sum();
    let built = Built {
        archive: archive.clone(),
        digest: manifest.digest.clone(),
        id: config.digest.clone(),
        compressed_size,
    };
    println!(
        "image: {IMAGE_NAME} (kproxy {}, {}, {} binary)",
        meta.version,
        meta.revision,
        profile.cargo().1
    );
    println!(
        "image: archive {} ({})",
        archive.display(),
        mib(file_size(&archive)?)
    );
    println!(
        "image: {} compressed ({} of Debian packages, {} of kproxy), {} unpacked",
        mib(compressed_size),
        mib(layers[0].blob.size),
        mib(layers[1].blob.size),
        mib(unpacked)
    );
    println!("image: digest {}", built.digest);
    println!("image: id     {}", built.id);
    println!("image: packages: {package_list}");
    println!(
        "image: load it with `podman load -i {0}` or `docker load -i {0}`",
        archive.display()
    );
    Ok(built)
}

/// The `--rootfs DIR` build: the image's files in `DIR` (which must not exist yet or be empty).
pub fn build_rootfs_with_binary(dir: &Path, profile: Profile) -> anyhow::Result<()> {
    require_root()?;
    let root = crate::workspace_root();
    let target = crate::target_dir();
    let binary = build_binary(&root, &target, profile)?;
    let epoch = source_date_epoch(&root).ok();
    build_rootfs(&root, dir, epoch.unwrap_or(0))?;
    install_binary(&binary, dir)
}

fn require_root() -> anyhow::Result<()> {
    if !is_root() {
        bail!("`cargo xtask image` needs root (mmdebstrap unpacks packages as root)");
    }
    Ok(())
}

/// Version, commit and time of the build, and the label values read from the workspace.
struct Metadata {
    version: String,
    revision: String,
    epoch: u64,
    description: String,
}

impl Metadata {
    fn read(root: &Path) -> anyhow::Result<Metadata> {
        let head = git(root, &["rev-parse", "HEAD"]).context("reading the commit (git)")?;
        let dirty = !git(root, &["status", "--porcelain", "--untracked-files=no"])?.is_empty();
        if dirty {
            println!("image: warning: uncommitted changes; the revision label says -dirty");
        }
        let manifest = std::fs::read_to_string(root.join("kproxy/Cargo.toml"))?;
        let description = manifest
            .lines()
            .find_map(|l| l.strip_prefix("description = "))
            .map(|d| d.trim_matches('"').to_string())
            .context("kproxy/Cargo.toml has no description")?;
        Ok(Metadata {
            version: env!("CARGO_PKG_VERSION").to_string(),
            revision: if dirty { format!("{head}-dirty") } else { head },
            epoch: source_date_epoch(root)?,
            description,
        })
    }

    /// The OCI annotation keys as labels.
    fn labels(&self, created: &str) -> Value {
        json!({
            "org.opencontainers.image.title": "kproxy",
            "org.opencontainers.image.description": self.description,
            "org.opencontainers.image.version": self.version,
            "org.opencontainers.image.revision": self.revision,
            "org.opencontainers.image.source": env!("CARGO_PKG_REPOSITORY"),
            "org.opencontainers.image.licenses": env!("CARGO_PKG_LICENSE"),
            "org.opencontainers.image.created": created,
        })
    }
}

/// `SOURCE_DATE_EPOCH` from the environment, else the commit's time (`git log -1 --format=%ct`).
fn source_date_epoch(root: &Path) -> anyhow::Result<u64> {
    if let Ok(v) = std::env::var("SOURCE_DATE_EPOCH") {
        return v
            .trim()
            .parse()
            .with_context(|| format!("SOURCE_DATE_EPOCH={v:?} is not a number of seconds"));
    }
    let t = git(root, &["log", "-1", "--format=%ct", "HEAD"])?;
    t.parse()
        .with_context(|| format!("git log printed {t:?} for the commit time"))
}

fn git(root: &Path, args: &[&str]) -> anyhow::Result<String> {
    let mut cmd = Command::new("git");
    cmd.arg("-C").arg(root).args(args);
    output(&mut cmd)
        .map(|s| s.trim().to_string())
        .with_context(|| format!("{} failed", display(&cmd)))
}

/// `cargo build [--release] --locked -p kproxy --bin kproxy`; the binary's path.
fn build_binary(root: &Path, target: &Path, profile: Profile) -> anyhow::Result<PathBuf> {
    let (flags, dir) = profile.cargo();
    let mut cmd = crate::process::cargo();
    cmd.arg("build")
        .args(flags)
        .args(["--locked", "--package", "kproxy", "--bin", "kproxy"])
        .current_dir(root);
    run_step("image", &mut cmd)?;
    let binary = target.join(dir).join("kproxy");
    if !binary.is_file() {
        bail!("cargo built no {}", binary.display());
    }
    Ok(binary)
}

/// One line of [`PACKAGES_FILE`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Package {
    pub name: String,
    /// `files-only`: its files without its dependencies (see [`finish_rootfs`]).
    pub files_only: bool,
}

/// The packages of a packages file: `name [files-only]` per line, `#` comments.
pub fn parse_packages(text: &str) -> anyhow::Result<Vec<Package>> {
    let mut out = vec![];
    for line in text.lines() {
        let words: Vec<&str> = line
            .split('#')
            .next()
            .unwrap_or("")
            .split_whitespace()
            .collect();
        match words.as_slice() {
            [] => {}
            [name] => out.push(Package {
                name: name.to_string(),
                files_only: false,
            }),
            [name, "files-only"] => out.push(Package {
                name: name.to_string(),
                files_only: true,
            }),
            _ => bail!("{PACKAGES_FILE}: cannot read {line:?} (`name [files-only]  # why`)"),
        }
    }
    Ok(out)
}

/// mmdebstrap into `rootfs`, then [`finish_rootfs`]; returns (package, version), sorted.
fn build_rootfs(root: &Path, rootfs: &Path, epoch: u64) -> anyhow::Result<Vec<(String, String)>> {
    let list = root.join(PACKAGES_FILE);
    let text =
        std::fs::read_to_string(&list).with_context(|| format!("reading {}", list.display()))?;
    let packages = parse_packages(&text)?;
    let names = |files_only: bool| -> Vec<String> {
        packages
            .iter()
            .filter(|p| p.files_only == files_only)
            .map(|p| p.name.clone())
            .collect()
    };
    let (installed, files_only) = (names(false), names(true));
    if installed.is_empty() {
        bail!("{PACKAGES_FILE} names no package");
    }
    if rootfs.exists() && std::fs::read_dir(rootfs)?.next().is_some() {
        bail!("{} exists and is not empty", rootfs.display());
    }
    let mut cmd = Command::new("mmdebstrap");
    cmd.env("SOURCE_DATE_EPOCH", epoch.to_string())
        .args(["--variant=extract", "--mode=root", "--quiet"])
        .arg(format!("--include={}", installed.join(",")))
        // The downloaded .debs stay until finish_rootfs has read their control files.
        .arg("--skip=cleanup/apt/cache");
    if !files_only.is_empty() {
        // Beside the others, from the same package lists (mmdebstrap's apt configuration).
        cmd.arg(format!(
            "--extract-hook=cd \"$1/var/cache/apt/archives\" && \
             APT_CONFIG=\"$MMDEBSTRAP_APT_CONFIG\" apt-get --quiet --quiet \
             -o APT::Sandbox::User=root download {}",
            files_only.join(" ")
        ));
    }
    cmd.arg("--aptopt=Acquire::Retries \"3\"")
        .arg(SUITE)
        .arg(rootfs)
        .args(SOURCES);
    run_step("image", &mut cmd)?;
    finish_rootfs(rootfs, &files_only)
}

/// What a container does not need removed, dpkg's status written, the relevant steps of
/// maintainer scripts done (see the module docs); the `files_only` packages unpacked and,
/// for ca-certificates, its bundle built. Returns (package, version) of every unpacked
/// package, sorted.
fn finish_rootfs(rootfs: &Path, files_only: &[String]) -> anyhow::Result<Vec<(String, String)>> {
    let archives = rootfs.join("var/cache/apt/archives");
    let mut debs: Vec<PathBuf> = std::fs::read_dir(&archives)
        .with_context(|| format!("reading {}", archives.display()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "deb"))
        .collect();
    debs.sort();
    let mut stanzas = vec![];
    for deb in &debs {
        let fields = output(Command::new("dpkg-deb").arg("--field").arg(deb))
            .with_context(|| format!("dpkg-deb --field {}", deb.display()))?;
        let stanza = status_stanza(&fields).with_context(|| deb.display().to_string())?;
        if files_only.contains(&stanza.0) {
            run_step(
                "image",
                Command::new("dpkg-deb")
                    .arg("--extract")
                    .arg(deb)
                    .arg(rootfs),
            )?;
        }
        stanzas.push(stanza);
    }
    for name in files_only {
        if !stanzas.iter().any(|(p, _, _)| p == name) {
            bail!("the files-only package {name} was not downloaded");
        }
    }
    if files_only.iter().any(|p| p == "ca-certificates") {
        write_ca_bundle(rootfs)?;
    }
    stanzas.sort();
    let status: String = stanzas
        .iter()
        .map(|(_, _, s)| s.as_str())
        .collect::<Vec<_>>()
        .join("\n");
    let packages = stanzas.into_iter().map(|(p, v, _)| (p, v)).collect();

    for gone in [
        "dev",
        "etc/resolv.conf",
        "etc/hostname",
        "etc/fstab",
        "etc/apt",
        "etc/dpkg",
        "var/cache/apt",
        "var/lib/apt",
        "var/lib/dpkg",
        "var/log",
        "var/run",
        "usr/share/man",
        "usr/share/info",
        "usr/share/lintian",
        "usr/share/bash-completion",
    ] {
        remove_any(&rootfs.join(gone))?;
    }
    for dir in ["dev", "var/lib/dpkg", "var/log"] {
        std::fs::create_dir_all(rootfs.join(dir))?;
    }
    std::fs::write(rootfs.join("var/lib/dpkg/status"), status)?;
    std::os::unix::fs::symlink("/run", rootfs.join("var/run"))?;
    std::fs::write(rootfs.join("etc/nsswitch.conf"), NSSWITCH)?;
    // Documentation: only the copyright files (the licence terms travel with the binaries).
    let doc = rootfs.join("usr/share/doc");
    if doc.is_dir() {
        for package in std::fs::read_dir(&doc)? {
            let package = package?.path();
            if !package.is_dir() || package.is_symlink() {
                continue;
            }
            for file in std::fs::read_dir(&package)? {
                let file = file?.path();
                if file.file_name().is_none_or(|n| n != "copyright") {
                    remove_any(&file)?;
                }
            }
        }
    }
    Ok(packages)
}

/// `/etc/ssl/certs/ca-certificates.crt` as ca-certificates' postinst makes it
/// (`update-ca-certificates` with every certificate its debconf question selects by default):
/// every `/usr/share/ca-certificates/*/*.crt`, sorted by path, concatenated, each ending in a
/// newline.
fn write_ca_bundle(rootfs: &Path) -> anyhow::Result<()> {
    let share = rootfs.join("usr/share/ca-certificates");
    let mut certs = vec![];
    for dir in std::fs::read_dir(&share).with_context(|| format!("reading {}", share.display()))? {
        let dir = dir?.path();
        if dir.is_dir() {
            for cert in std::fs::read_dir(&dir)? {
                let cert = cert?.path();
                if cert.extension().is_some_and(|x| x == "crt") {
                    certs.push(cert);
                }
            }
        }
    }
    certs.sort();
    if certs.is_empty() {
        bail!("no certificate under {}", share.display());
    }
    let mut bundle = String::new();
    for cert in &certs {
        bundle.push_str(&std::fs::read_to_string(cert)?);
        if !bundle.ends_with('\n') {
            bundle.push('\n');
        }
    }
    let dest = rootfs.join("etc/ssl/certs");
    std::fs::create_dir_all(&dest)?;
    std::fs::write(dest.join("ca-certificates.crt"), bundle)?;
    Ok(())
}

/// A dpkg status stanza from `dpkg-deb --field` output: `Status: install ok installed` after
/// `Package:`, as dpkg writes it. Returns (package, version, stanza).
pub fn status_stanza(fields: &str) -> anyhow::Result<(String, String, String)> {
    let field = |name: &str| {
        fields
            .lines()
            .find_map(|l| l.strip_prefix(&format!("{name}: ")))
            .map(|v| v.trim().to_string())
    };
    let package = field("Package").context("no Package field")?;
    let version = field("Version").context("no Version field")?;
    let mut stanza = String::new();
    for line in fields.lines() {
        stanza.push_str(line);
        stanza.push('\n');
        if line.starts_with("Package: ") {
            stanza.push_str("Status: install ok installed\n");
        }
    }
    Ok((package, version, stanza))
}

/// Copies the release binary to `<dir>/usr/local/bin/kproxy`, mode 0755.
fn install_binary(binary: &Path, dir: &Path) -> anyhow::Result<()> {
    use std::os::unix::fs::PermissionsExt as _;
    let dest = dir.join(BINARY_PATH);
    std::fs::create_dir_all(dest.parent().expect("has a parent"))?;
    std::fs::copy(binary, &dest).with_context(|| format!("copying to {}", dest.display()))?;
    std::fs::set_permissions(&dest, std::fs::Permissions::from_mode(0o755))?;
    Ok(())
}

/// A content-addressed file under `blobs/sha256/`.
#[derive(Debug, Clone)]
struct Blob {
    digest: String,
    size: u64,
}

struct Layer {
    blob: Blob,
    /// `sha256:…` of the uncompressed tar.
    diff_id: String,
    tar_size: u64,
}

/// Tars `dir` reproducibly into `<stem>.tar`, gzips it into a blob.
fn make_layer(dir: &Path, stem: &Path, blobs: &Path, epoch: u64) -> anyhow::Result<Layer> {
    let tar = stem.with_extension("tar");
    let mut entries: Vec<String> = std::fs::read_dir(dir)?
        .map(|e| e.map(|e| e.file_name().to_string_lossy().into_owned()))
        .collect::<Result<_, _>>()?;
    entries.sort();
    let entries: Vec<&str> = entries.iter().map(String::as_str).collect();
    reproducible_tar(dir, &entries, &tar, epoch)?;
    let diff_id = sha256(&tar)?;
    let gz = stem.with_extension("tar.gz");
    let out = std::fs::File::create(&gz)?;
    // Level 6 (gzip's default): -9 is 1 % smaller and 3–4× slower here (30 s for the dev
    // binary's layer).
    let status = Command::new("gzip")
        .args(["-n", "-6", "-c"])
        .arg(&tar)
        .stdout(out)
        .status()
        .context("running gzip")?;
    if !status.success() {
        bail!("gzip {} failed ({status})", tar.display());
    }
    let digest = sha256(&gz)?;
    let size = file_size(&gz)?;
    std::fs::rename(&gz, blobs.join(&digest["sha256:".len()..]))?;
    let tar_size = file_size(&tar)?;
    std::fs::remove_file(&tar)?;
    Ok(Layer {
        blob: Blob { digest, size },
        diff_id,
        tar_size,
    })
}

/// `tar` of `entries` (relative to `dir`) into `out`, the same bytes for the same files: names
/// sorted, owner and group 0, mtimes clamped to `epoch`, pax headers without atime/ctime, no
/// ACLs, extended attributes or SELinux contexts.
fn reproducible_tar(dir: &Path, entries: &[&str], out: &Path, epoch: u64) -> anyhow::Result<()> {
    let mut cmd = Command::new("tar");
    cmd.env("LC_ALL", "C")
        .arg("--create")
        .arg(format!("--file={}", out.display()))
        .arg(format!("--directory={}", dir.display()))
        .args([
            "--sort=name",
            "--format=pax",
            "--pax-option=exthdr.name=%d/PaxHeaders/%f,delete=atime,delete=ctime",
            "--clamp-mtime",
            "--owner=0",
            "--group=0",
            "--numeric-owner",
            "--no-acls",
            "--no-xattrs",
            "--no-selinux",
        ])
        .arg(format!("--mtime=@{epoch}"))
        .arg("--")
        .args(entries);
    let o = cmd
        .output()
        .with_context(|| format!("spawning {}", display(&cmd)))?;
    if !o.status.success() {
        bail!(
            "{} failed ({}): {}",
            display(&cmd),
            o.status,
            String::from_utf8_lossy(&o.stderr).trim()
        );
    }
    Ok(())
}

fn write_blob(blobs: &Path, bytes: &[u8]) -> anyhow::Result<Blob> {
    let tmp = blobs.join("partial");
    std::fs::write(&tmp, bytes)?;
    let digest = sha256(&tmp)?;
    std::fs::rename(&tmp, blobs.join(&digest["sha256:".len()..]))?;
    Ok(Blob {
        digest,
        size: bytes.len() as u64,
    })
}

fn blob_path(digest: &str) -> String {
    format!("blobs/sha256/{}", &digest["sha256:".len()..])
}

/// `sha256:<hex>` of a file (`sha256sum`).
fn sha256(path: &Path) -> anyhow::Result<String> {
    let out = output(Command::new("sha256sum").arg(path))
        .with_context(|| format!("sha256sum {}", path.display()))?;
    let hex = out.split_whitespace().next().unwrap_or_default();
    if hex.len() != 64 {
        bail!("sha256sum printed {out:?}");
    }
    Ok(format!("sha256:{hex}"))
}

/// Compact JSON (the bytes are hashed: serde_json's maps keep keys sorted).
fn to_json(v: &Value) -> Vec<u8> {
    serde_json::to_vec(v).expect("JSON values serialize")
}

fn file_size(path: &Path) -> anyhow::Result<u64> {
    Ok(std::fs::metadata(path)
        .with_context(|| format!("stat {}", path.display()))?
        .len())
}

fn mib(bytes: u64) -> String {
    format!("{:.1} MiB", bytes as f64 / (1024.0 * 1024.0))
}

fn remove_any(path: &Path) -> anyhow::Result<()> {
    match std::fs::symlink_metadata(path) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(e).with_context(|| format!("stat {}", path.display())),
        Ok(m) if m.is_dir() => {
            std::fs::remove_dir_all(path).with_context(|| format!("removing {}", path.display()))
        }
        Ok(_) => std::fs::remove_file(path).with_context(|| format!("removing {}", path.display())),
    }
}

fn remove_dir_if_exists(dir: &Path) -> anyhow::Result<()> {
    remove_any(dir)
}

/// `1970-01-01T00:00:00Z` form of a Unix time (UTC).
pub fn rfc3339(epoch: u64) -> String {
    let days = (epoch / 86_400) as i64;
    let secs = epoch % 86_400;
    // Howard Hinnant's civil_from_days.
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    let mut s = String::new();
    let _ = write!(
        s,
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}Z",
        secs / 3600,
        secs % 3600 / 60,
        secs % 60
    );
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unix_times_print_as_rfc3339_utc() {
        assert_eq!(rfc3339(0), "1970-01-01T00:00:00Z");
        assert_eq!(rfc3339(951_782_400), "2000-02-29T00:00:00Z");
        assert_eq!(rfc3339(1_700_000_000), "2023-11-14T22:13:20Z");
        assert_eq!(rfc3339(4_107_542_399), "2100-02-28T23:59:59Z");
    }

    #[test]
    fn the_shared_package_list_parses() {
        let text = std::fs::read_to_string(crate::workspace_root().join(PACKAGES_FILE)).unwrap();
        let packages = parse_packages(&text).unwrap();
        for needed in ["iptables", "ipset", "nftables"] {
            assert!(
                packages.iter().any(|p| p.name == needed && !p.files_only),
                "{needed}: {packages:?}"
            );
        }
        for p in &packages {
            assert!(
                p.name
                    .chars()
                    .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || "+-.".contains(c)),
                "{p:?} is not a package name"
            );
        }
        let p = |name: &str, files_only| Package {
            name: name.into(),
            files_only,
        };
        assert_eq!(
            parse_packages("# c\n a  # why\n\nb files-only # why\n").unwrap(),
            vec![p("a", false), p("b", true)]
        );
        assert!(parse_packages("a b\n").is_err());
    }

    #[test]
    fn status_stanzas_say_installed_after_the_package_line() {
        let (p, v, s) =
            status_stanza("Package: ipset\nVersion: 7.17-1\nArchitecture: amd64\n").unwrap();
        assert_eq!((p.as_str(), v.as_str()), ("ipset", "7.17-1"));
        assert_eq!(
            s,
            "Package: ipset\nStatus: install ok installed\nVersion: 7.17-1\nArchitecture: amd64\n"
        );
        assert!(status_stanza("Version: 1\n").is_err());
    }
}
