//! The CA files of `[broker] ca_file` and `[redis] ca_file` (docs/design.md "URLs and TLS").
//!
//! `amqps://` and `rediss://` trust the system roots unless a CA file is set; then they trust
//! exactly the certificates in that file (PEM), not the system roots as well. Both the broker
//! and the Redis connection read the file with [`read_ca_file`], so a file the config check
//! accepted is one both clients accept.

use rustls_pki_types::pem::PemObject;
use rustls_pki_types::CertificateDer;
use std::path::{Path, PathBuf};

/// Why a CA file cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum CaFileError {
    /// The file cannot be read.
    #[error("cannot read the CA file {}: {source}", path.display())]
    Read {
        /// The file.
        path: PathBuf,
        /// What the OS said.
        source: std::io::Error,
    },
    /// The file is not PEM, or a certificate in it is malformed.
    #[error("the CA file {} is not valid PEM: {source}", path.display())]
    Pem {
        /// The file.
        path: PathBuf,
        /// What the PEM parser said.
        source: rustls_pki_types::pem::Error,
    },
    /// The file holds no `CERTIFICATE` section.
    #[error("the CA file {} holds no certificate (expected PEM `-----BEGIN CERTIFICATE-----`)", path.display())]
    Empty {
        /// The file.
        path: PathBuf,
    },
}

/// A CA file read and checked: its PEM text and the certificates in it.
#[derive(Debug, Clone)]
pub struct CaFile {
    /// The file as read (what redis-rs takes).
    pub pem: Vec<u8>,
    /// The certificates in it, in file order (what rustls takes).
    pub certs: Vec<CertificateDer<'static>>,
}

/// Reads `path` and checks that it holds at least one PEM certificate.
pub fn read_ca_file(path: &Path) -> Result<CaFile, CaFileError> {
    let pem = std::fs::read(path).map_err(|source| CaFileError::Read {
        path: path.to_owned(),
        source,
    })?;
    let certs = CertificateDer::pem_slice_iter(&pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|source| CaFileError::Pem {
            path: path.to_owned(),
            source,
        })?;
    if certs.is_empty() {
        return Err(CaFileError::Empty {
            path: path.to_owned(),
        });
    }
    Ok(CaFile { pem, certs })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scratch(name: &str, text: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("drumline-tls-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join(name);
        std::fs::write(&path, text).unwrap();
        path
    }

    #[test]
    fn a_missing_file_or_one_without_a_certificate_is_refused() {
        let missing = Path::new("/nonexistent/drumline/ca.pem");
        assert!(matches!(
            read_ca_file(missing),
            Err(CaFileError::Read { .. })
        ));
        let empty = scratch("empty.pem", "not a certificate\n");
        let err = read_ca_file(&empty).unwrap_err();
        assert!(matches!(err, CaFileError::Empty { .. }), "{err}");
        assert!(err.to_string().contains("empty.pem"), "{err}");
    }

    #[test]
    #[cfg(feature = "config")]
    fn config_refuses_a_bad_ca_file_at_load_naming_section_and_key() {
        let empty = scratch("config-empty.pem", "");
        for section in ["broker", "redis"] {
            let text = format!("[{section}]\nca_file = {:?}\n", empty.to_str().unwrap());
            let err =
                crate::config::Config::parse(&text, Path::new("d.toml"), |_| None).unwrap_err();
            assert_eq!(err.place.as_deref(), Some(format!("[{section}]").as_str()));
            assert_eq!(err.key.as_deref(), Some("ca_file"));
        }
        let missing = "[redis]\nca_file = \"/nonexistent/ca.pem\"\n";
        let err = crate::config::Config::parse(missing, Path::new("d.toml"), |_| None).unwrap_err();
        assert!(err.to_string().contains("/nonexistent/ca.pem"), "{err}");
    }

    #[test]
    #[cfg(feature = "config")]
    fn without_ca_file_the_system_roots_are_used() {
        let c = crate::config::Config::parse("", Path::new("d.toml"), |_| None).unwrap();
        assert_eq!((c.broker_ca_file, c.redis_ca_file), (None, None));
    }
}
