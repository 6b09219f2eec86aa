/* SPDX-License-Identifier: GPL-2.0 */
/*
 * pktclass.h - what a packet read from a tun/tap queue is, shared by
 * tunreader (read()) and vhostrx (vhost-net RX buffers).
 *
 * Ours: IPv4 UDP whose payload starts with udpburst's "NDRP" header
 * (id, seq, big endian); pktgen: payload starts with pktgen's magic;
 * other: anything else well formed (ARP, IPv6, other protocols);
 * bad: lengths that do not match what the kernel handed us (a mis-parsed
 * virtio-net header, a truncated frame).
 */
#ifndef NODROP_PKTCLASS_H
#define NODROP_PKTCLASS_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#define MAX_IDS 16
#define PKTGEN_MAGIC 0xbe9be955u

enum pkt_kind { PKT_BAD, PKT_OTHER, PKT_OURS, PKT_PKTGEN };

static inline uint16_t be16(const unsigned char *p)
{
	return (uint16_t)(p[0] << 8 | p[1]);
}

static inline uint32_t be32(const unsigned char *p)
{
	return (uint32_t)p[0] << 24 | (uint32_t)p[1] << 16 |
	       (uint32_t)p[2] << 8 | p[3];
}

/*
 * p, len: the frame (after any virtio-net header); tap: it starts with an
 * Ethernet header.  For PKT_OURS, *id and *seq are udpburst's fields.
 */
static inline enum pkt_kind pkt_classify(const unsigned char *p, size_t len, int tap,
					 uint32_t *id, uint32_t *seq)
{
	size_t ip = 0, ihl, tot, udp;

	if (tap) {
		if (len < 14)
			return PKT_BAD;
		if (be16(p + 12) != 0x0800)
			return PKT_OTHER;
		ip = 14;
	}
	if (len < ip + 20)
		return PKT_BAD;
	if ((p[ip] >> 4) != 4)
		return (p[ip] >> 4) == 6 ? PKT_OTHER : PKT_BAD;
	ihl = (size_t)(p[ip] & 0xf) * 4;
	tot = be16(p + ip + 2);
	/* tap frames may be padded to the Ethernet minimum */
	if (ihl < 20 || tot < ihl || (tap ? ip + tot > len : ip + tot != len))
		return PKT_BAD;
	if (p[ip + 9] != 17 || tot < ihl + 8 + 16)
		return PKT_OTHER;
	udp = ip + ihl + 8;
	if (!memcmp(p + udp, "NDRP", 4)) {
		*id = be32(p + udp + 4);
		*seq = be32(p + udp + 8);
		return PKT_OURS;
	}
	return be32(p + udp) == PKTGEN_MAGIC ? PKT_PKTGEN : PKT_OTHER;
}

#endif /* NODROP_PKTCLASS_H */
