// Lists the members of a ustar/GNU tar archive: enough to check what the appliance streams,
// with no dependency. Returns [{name, size, type, data}] (`data` a view of the member's bytes)
// and throws on a malformed archive.

export function tarMembers(buffer) {
  const members = [];
  let offset = 0;
  let longName = null;
  while (offset + 512 <= buffer.length) {
    const header = buffer.subarray(offset, offset + 512);
    if (header.every((b) => b === 0)) break; // end-of-archive marker
    const field = (start, length) => {
      const raw = header.subarray(start, start + length);
      const end = raw.indexOf(0);
      return raw.subarray(0, end === -1 ? length : end).toString('utf8');
    };
    const checksum = parseInt(field(148, 8).trim() || 'NaN', 8);
    let sum = 0;
    for (let i = 0; i < 512; i += 1) sum += i >= 148 && i < 156 ? 32 : header[i];
    if (checksum !== sum) throw new Error(`tar header at byte ${offset}: checksum ${checksum}, computed ${sum}`);
    const size = parseInt(field(124, 12).trim() || '0', 8);
    const type = String.fromCharCode(header[156] || 48);
    const prefix = field(257, 6).startsWith('ustar') ? field(345, 155) : '';
    let name = prefix ? `${prefix}/${field(0, 100)}` : field(0, 100);
    const dataStart = offset + 512;
    if (dataStart + size > buffer.length) throw new Error(`tar member ${name} is cut short`);
    if (type === 'L') {
      // GNU long name: the next header's name is in this member's data.
      longName = buffer.subarray(dataStart, dataStart + size).toString('utf8').replace(/\0+$/, '');
    } else if (type !== 'x' && type !== 'g') {
      if (longName !== null) {
        name = longName;
        longName = null;
      }
      members.push({ name, size, type, data: buffer.subarray(dataStart, dataStart + size) });
    }
    offset = dataStart + Math.ceil(size / 512) * 512;
  }
  if (members.length === 0) throw new Error('the archive holds no member');
  return members;
}
