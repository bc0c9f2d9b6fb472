;;;; access-log.lisp -- the native API's access log: one line per answer,
;;;; the engine's own included (LOG-ENGINE-ANSWER), in the Combined Log
;;;; Format nginx and Apache write, or as JSON lines, to a file or a stream
;;;; (GALLOP:START's :ACCESS-LOG).  The Hunchentoot layer makes its combined
;;;; lines here too (FILL-LOG-LINE).
;;;;
;;;; Off the request path: a worker makes its line (octets, escaped so that
;;;; a client can neither break a line nor forge one) and appends it to a
;;;; ring of its own (one per worker thread and log: it alone writes the
;;;; ring's head, the log's thread alone its tail, so neither takes a lock
;;;; or an atomic instruction); any other thread (an app answering later)
;;;; pushes it onto the log's queue with one compare-and-swap.  The log's
;;;; own thread takes what the rings and the queue hold every
;;;; +FLUSH-INTERVAL+ (sooner once a ring is 3/4 full, or +WAKE-BYTES+ wait
;;;; in the queue) and writes it with one write(2) (O_APPEND: lines of
;;;; several processes on one file never mix).  A disk that cannot keep up
;;;; costs at most a full ring a worker (+RING-BYTES+) and
;;;; *ACCESS-LOG-MAX-QUEUED-BYTES* (32 MiB) queued: past them lines are
;;;; dropped, and counted (a line for the queue has its room counted before
;;;; it is made, so none is made to be dropped, and is kept at its length).
;;;; A file is opened again by its name on GALLOP:REOPEN-ACCESS-LOGS (or
;;;; SIGHUP, GALLOP:REOPEN-LOGS-ON-SIGHUP), for logrotate.

(in-package #:gallop)

(defconstant +flush-interval+ 0.05
  "Seconds between the writer's passes over the rings and the queue.")

(defconstant +wake-bytes+ (* 256 1024)
  "Octets queued that wake the writer before its interval.")

(defconstant +max-queued-bytes+ (* 32 1024 1024)
  "Octets queued past which lines are dropped (counted in ACCESS-LOG-DROPPED).")

(defvar *access-log-max-queued-bytes* +max-queued-bytes+
  "The queue's bound of the access logs opened from now on, in octets.")

(defconstant +ring-bytes+ (* 256 1024)
  "The octets of a worker's ring (a power of two): a worker fills a quarter
of it in one +FLUSH-INTERVAL+ at a hundred thousand lines a second, so the
writer's timer, not the worker, wakes it under any load a worker can make.")

(defstruct (ring (:constructor make-ring (thread)) (:copier nil))
  "A worker thread's lines for one log, in a circle of octets.  HEAD and
TAIL count octets ever appended and ever taken: the worker alone sets HEAD,
after the octets it covers; the log's thread alone sets TAIL, after it
copied them out."
  (thread nil)
  (octets (make-array +ring-bytes+ :element-type '(unsigned-byte 8))
   :type (simple-array (unsigned-byte 8) (*)) :read-only t)
  (head 0 :type sb-ext:word)
  (tail 0 :type sb-ext:word))

(defstruct (access-log (:constructor %make-access-log (destination format)) (:copier nil))
  (destination nil)              ; a pathname (a file, appended to) or a stream
  ;; The writer's own: what one pass writes, copied together (grown as needed).
  (buffer (make-array 0 :element-type '(unsigned-byte 8))
   :type (simple-array (unsigned-byte 8) (*)))
  (format :combined :type (member :combined :json))
  (fd -1 :type fixnum)           ; the file's, while open
  (queue '())                    ; (octets . length) entries, newest first
  (rings '())                    ; the workers' RINGs, added under RINGS-LOCK
  (rings-lock (sb-thread:make-mutex :name "gallop access log rings"))
  (queued-bytes 0 :type sb-ext:word)  ; queued, and reserved by lines in the making
  (max-queued-bytes *access-log-max-queued-bytes* :type fixnum :read-only t)
  (dropped 0 :type sb-ext:word)      ; lines not queued: no room, or not made
  (lost-octets 0 :type sb-ext:word)  ; octets the destination did not take
  (reopen nil)
  (stop nil)
  (wake (sb-thread:make-semaphore :name "gallop access log"))
  (thread nil))

(defmethod print-object ((log access-log) stream)
  (print-unreadable-object (log stream :type t)
    (format stream "~A" (access-log-destination log))))

(defvar *access-logs* '() "Open access logs, for GALLOP:REOPEN-ACCESS-LOGS.")
(defvar *access-logs-lock* (sb-thread:make-mutex :name "gallop access logs"))

;;; Writing

(defun open-log-file (path)
  "An fd appending to PATH (made if missing, mode 0640 before the umask)."
  (let ((fd (sb-unix:unix-open (namestring (merge-pathnames path))
                               (logior sb-unix:o_wronly sb-unix:o_creat sb-unix:o_append
                                       #o2000000) ; O_CLOEXEC
                               #o640)))
    (unless fd
      (error "Cannot open the access log ~A." path))
    fd))

(defun write-all (fd octets end)
  "write(2) OCTETS[0,END) to FD, all of it (retrying a short write); NIL on
an error."
  (let ((start 0))
    (loop while (< start end)
          do (multiple-value-bind (n errno)
                 (sb-sys:with-pinned-objects (octets)
                   (sb-unix:unix-write fd octets start (- end start)))
               (cond (n (incf start n))
                     ((= errno sb-unix:eintr))
                     (t (return-from write-all nil)))))
    t))

(defun take-queue (log)
  "The lines queued on LOG, oldest first, and their octets; the queue is
left empty."
  (let ((entries (loop for old = (access-log-queue log)
                       until (eq old (sb-ext:compare-and-swap (access-log-queue log) old '()))
                       finally (return old))))
    (let ((total (loop for entry in entries sum (the fixnum (cdr entry)))))
      (sb-ext:atomic-decf (access-log-queued-bytes log) total)
      (values (nreverse entries) total))))

(defun ensure-buffer (log size keep)
  "LOG's writer buffer, at least SIZE octets long, its first KEEP octets kept."
  (let ((old (access-log-buffer log)))
    (when (< (length old) size)
      (let ((new (make-array (max size (* 2 (length old))) :element-type '(unsigned-byte 8))))
        (replace new old :end2 keep)
        (setf (access-log-buffer log) new))))
  (access-log-buffer log))

(defun take-rings (log)
  "Copy what the workers' rings of LOG hold to its buffer, freeing their
room; the octets copied.  A ring whose thread ended, once empty, is
dropped."
  (let ((at 0))
    (declare (type fixnum at))
    (dolist (ring (sb-thread:with-mutex ((access-log-rings-lock log))
                    (copy-list (access-log-rings log))))
      (let* ((alive (sb-thread:thread-alive-p (ring-thread ring)))
             (tail (ring-tail ring))
             (head (prog1 (ring-head ring)
                     ;; The octets after the head that covers them.
                     (sb-thread:barrier (:read))))
             (count (- head tail)))
        (declare (type sb-ext:word tail head) (type fixnum count))
        (cond ((plusp count)
               (let* ((octets (ring-octets ring))
                      (buffer (ensure-buffer log (+ at count) at))
                      (start (logand tail (1- +ring-bytes+)))
                      (first (min count (- +ring-bytes+ start))))
                 (replace buffer octets :start1 at :start2 start :end2 (+ start first))
                 (replace buffer octets :start1 (+ at first) :start2 0 :end2 (- count first))
                 (incf at count)
                 (sb-thread:barrier (:memory))
                 (setf (ring-tail ring) head)))
              ((not alive)
               ;; Dead before the head was read: nothing more will come.
               (sb-thread:with-mutex ((access-log-rings-lock log))
                 (setf (access-log-rings log) (remove ring (access-log-rings log))))))))
    at))

(defun flush-access-log (log)
  "Write what LOG's rings and queue hold (in its thread, or at its end)."
  (let ((from-rings (take-rings log)))
    (declare (type fixnum from-rings))
    (multiple-value-bind (entries queued) (take-queue log)
      (declare (type fixnum queued))
      (when (or entries (plusp from-rings))
        (let* ((total (+ from-rings queued))
               (octets (ensure-buffer log total from-rings))
               (at from-rings))
          (declare (type fixnum at))
          (loop for (line . length) in entries
                do (replace octets (the (simple-array (unsigned-byte 8) (*)) line)
                            :start1 at :end2 length)
                   (incf at length))
          (let ((destination (access-log-destination log)))
            (if (streamp destination)
                (ignore-errors
                 (if (subtypep (stream-element-type destination) 'character)
                     (write-string (sb-ext:octets-to-string octets :external-format :latin-1
                                                                   :end total)
                                   destination)
                     (write-sequence octets destination :end total))
                 (finish-output destination))
                (when (and (>= (access-log-fd log) 0)
                           (not (write-all (access-log-fd log) octets total)))
                  ;; A full or failing disk: what this pass held is lost,
                  ;; counted in octets as lines cannot be told apart here.
                  (sb-ext:atomic-incf (access-log-lost-octets log) total)))))))))

(defun access-log-loop (log)
  (loop
    (sb-thread:wait-on-semaphore (access-log-wake log) :timeout +flush-interval+)
    (when (and (access-log-reopen log) (not (streamp (access-log-destination log))))
      (setf (access-log-reopen log) nil)
      ;; The new file first: a line is never lost between the two.
      (let ((fd (ignore-errors (open-log-file (access-log-destination log)))))
        (when fd
          (sb-unix:unix-close (shiftf (access-log-fd log) fd)))))
    (flush-access-log log)
    (when (access-log-stop log)
      (flush-access-log log)
      (return))))

(defun open-access-log (destination format)
  "An access log writing lines of FORMAT (:COMBINED or :JSON) to DESTINATION
\(a pathname or namestring: a file, appended to; or a stream), with its
writer thread running."
  (check-type format (member :combined :json))
  (let ((log (%make-access-log (if (stringp destination) (pathname destination) destination)
                               format)))
    (unless (streamp destination)
      (setf (access-log-fd log) (open-log-file destination)))
    (setf (access-log-thread log)
          (sb-thread:make-thread #'access-log-loop :name "gallop access log" :arguments (list log)))
    (sb-thread:with-mutex (*access-logs-lock*)
      (push log *access-logs*))
    log))

(defun close-access-log (log)
  "Write what LOG holds, end its thread, and close its file."
  (sb-thread:with-mutex (*access-logs-lock*)
    (setf *access-logs* (remove log *access-logs*)))
  (setf (access-log-stop log) t)
  (sb-thread:signal-semaphore (access-log-wake log))
  ;; A destination that blocks (a stalled pipe, a hung mount) must not hold
  ;; the stop: the writer is then left to it, and so is its fd, which a
  ;; closed fd's number reused would otherwise get the writer's lines.
  (unless (eq :timeout (sb-thread:join-thread (access-log-thread log)
                                              :default :timeout :timeout 5))
    (when (>= (access-log-fd log) 0)
      (sb-unix:unix-close (shiftf (access-log-fd log) -1))))
  log)

(defun reopen-access-logs ()
  "Open every access log file again by its name, at once (for logrotate, after
it moved the files: lines written before go to the moved file, later ones to
the new)."
  ;; No lock: called from a signal handler too.  The list is only ever
  ;; replaced whole, so one read of it is a list as it was.
  (dolist (log *access-logs*)
    (setf (access-log-reopen log) t)
    (sb-thread:signal-semaphore (access-log-wake log)))
  (values))

(defun reopen-logs-on-sighup ()
  "Make SIGHUP (logrotate's postrotate: kill -HUP) call
GALLOP:REOPEN-ACCESS-LOGS.  SBCL's default on SIGHUP is to exit."
  (sb-sys:enable-interrupt sb-unix:sighup
                           (lambda (signal info context)
                             (declare (ignore signal info context))
                             (reopen-access-logs)))
  (values))

;;; Making a line

(defvar *log-second* (cons -1 nil)
  "The last second a line was made in, and its two time stamps (CLF's and
ISO 8601's) as octets: made once a second, replaced whole.")

(defun log-time-stamps ()
  "This second's CLF and ISO 8601 time stamps (UTC), as octets."
  (let ((now (get-universal-time))
        (cached *log-second*))
    (if (= now (car cached))
        (values (cadr cached) (cddr cached))
        (multiple-value-bind (s m h day month year) (decode-universal-time now 0)
          (let ((clf (map '(simple-array (unsigned-byte 8) (*)) #'char-code
                          (format nil "~2,'0D/~A/~D:~2,'0D:~2,'0D:~2,'0D +0000"
                                  day (svref #("Jan" "Feb" "Mar" "Apr" "May" "Jun" "Jul"
                                               "Aug" "Sep" "Oct" "Nov" "Dec")
                                             (1- month))
                                  year h m s)))
                (iso (map '(simple-array (unsigned-byte 8) (*)) #'char-code
                          (format nil "~D-~2,'0D-~2,'0DT~2,'0D:~2,'0D:~2,'0DZ"
                                  year month day h m s))))
            (setf *log-second* (cons now (cons clf iso)))
            (values clf iso))))))

;;; What a line escapes.  Every string a line carries from a request is its
;;; octets, one character each (heads are read as Latin-1); each is escaped
;;; so that a client can neither break a line nor forge a field:
;;;  - :CLF (the combined format), as nginx's escape=default: `"`, `\`, and
;;;    the octets below 32 or above 126 as \xHH;
;;;  - :JSON, the octets read as UTF-8: a valid sequence (RFC 3629: shortest
;;;    form, no surrogate, nothing past U+10FFFF) is copied as it is, JSON
;;;    text being UTF-8; `"` and `\` are \" and \\; control octets (below 32,
;;;    and 127) and every octet that begins no valid sequence are \u00HH, so
;;;    an invalid octet reads back as the character of its number, as the
;;;    combined format's \xHH does (doc/design.md, "JSON access-log lines
;;;    read the request as UTF-8").
;;; A character past 255 (none comes from a request head) is "?".

(defun ascii-octets (string)
  (map '(simple-array (unsigned-byte 8) (*)) #'char-code string))

(declaim (inline utf-8-sequence-length))
(defun utf-8-sequence-length (string i end)
  "The length of the valid UTF-8 sequence (RFC 3629, table in section 4)
whose octets, the codes of STRING's characters, begin at I before END; NIL
when none begins there."
  (declare (type string string) (type fixnum i end))
  (flet ((octet (k)
           (declare (type fixnum k))
           (if (< k end) (char-code (char string k)) 0)))
    (declare (inline octet))
    (macrolet ((in (k low high) `(<= ,low (octet (+ i ,k)) ,high)))
      (let ((lead (octet i)))
        (cond ((<= #xC2 lead #xDF) (and (in 1 #x80 #xBF) 2))
              ((= lead #xE0) (and (in 1 #xA0 #xBF) (in 2 #x80 #xBF) 3))
              ((= lead #xED) (and (in 1 #x80 #x9F) (in 2 #x80 #xBF) 3))
              ((<= #xE1 lead #xEF) (and (in 1 #x80 #xBF) (in 2 #x80 #xBF) 3))
              ((= lead #xF0) (and (in 1 #x90 #xBF) (in 2 #x80 #xBF) (in 3 #x80 #xBF) 4))
              ((<= #xF1 lead #xF3) (and (in 1 #x80 #xBF) (in 2 #x80 #xBF) (in 3 #x80 #xBF) 4))
              ((= lead #xF4) (and (in 1 #x80 #x8F) (in 2 #x80 #xBF) (in 3 #x80 #xBF) 4))
              (t nil))))))

(defmacro with-line-writer ((put put-octets put-text) buffer &body body)
  "BODY with LINE, the octet vector BUFFER (long enough: the caller made sure
of it), and local functions that append to it: PUT an octet, PUT-OCTETS an
octet vector, PUT-TEXT a string from a request escaped for STYLE :CLF or
:JSON (see above).  Returns the line and its length."
  `(let ((line ,buffer)
         (at 0))
     (declare (type (simple-array (unsigned-byte 8) (*)) line) (type fixnum at)
              ;; No bounds checks: BUFFER is as long as LOG-LINE-SIZE's
              ;; bound, every part of the line counted at its longest.
              (optimize speed (safety 0)))
     (labels ((,put (octet)
                (declare (type (unsigned-byte 8) octet))
                (setf (aref line at) octet)
                (incf at))
              (,put-octets (octets)
                ;; A loop: REPLACE's call costs more than these few octets.
                (declare (type (simple-array (unsigned-byte 8) (*)) octets))
                (loop for octet across octets do (,put octet)))
              (hex (digits code)
                (declare (type simple-string digits) (type (unsigned-byte 8) code))
                (,put (char-code (schar digits (ldb (byte 4 4) code))))
                (,put (char-code (schar digits (ldb (byte 4 0) code)))))
              (put-clf (code)
                (declare (type fixnum code))
                (cond ((> code 255) (,put 63))
                      ((and (<= 32 code 126) (/= code 34) (/= code 92)) (,put code))
                      ;; nginx's escape=default: \xHH
                      (t (,put 92) (,put 120) (hex "0123456789ABCDEF" code))))
              (put-json-ascii (code)
                (declare (type (integer 0 127) code))
                (cond ((or (= code 34) (= code 92)) (,put 92) (,put code))
                      ((and (<= 32 code) (/= code 127)) (,put code))
                      (t (put-u00 code))))
              (put-u00 (code)
                (declare (type (unsigned-byte 8) code))
                (,put 92) (,put 117) (,put 48) (,put 48) (hex "0123456789abcdef" code))
              (,put-text (string style)
                (macrolet ((walk (type)
                             `(let ((s string)
                                    (i 0))
                                (declare (type ,type s) (type fixnum i))
                                (if (eq style :clf)
                                    (loop for char across s do (put-clf (char-code char)))
                                    (let ((n (length s)))
                                      (loop while (< i n)
                                            do (let ((code (char-code (char s i))))
                                                 (cond ((< code 128) (put-json-ascii code) (incf i))
                                                       ((> code 255) (,',put 63) (incf i))
                                                       (t (let ((k (utf-8-sequence-length s i n)))
                                                            (if k
                                                                (loop repeat k
                                                                      do (,',put (char-code (char s i)))
                                                                         (incf i))
                                                                (progn (put-u00 code) (incf i)))))))))))))
                  (typecase string
                    ((simple-array character (*)) (walk (simple-array character (*))))
                    (simple-base-string (walk simple-base-string))
                    (t (walk string))))))
       (declare (inline ,put ,put-octets hex put-clf put-json-ascii)
                (ignorable #',put-octets #',put-text))
       ,@body
       (values line at))))

(defmacro text-octets (string)
  "STRING (a literal, ASCII) as octets, made once."
  `(load-time-value (ascii-octets ,string) t))

(declaim (inline escaped-size))
(defun escaped-size (string)
  "The most octets STRING (or NIL) may take escaped (six a character)."
  (if string (the fixnum (* 6 (length (the string string)))) 0))

(defun name-octets (symbol)
  "SYMBOL's name as octets, kept on its property list: a method or protocol
keyword (a token of the request line: nothing in it is escaped)."
  (or (get symbol 'log-octets)
      (setf (get symbol 'log-octets)
            (map '(simple-array (unsigned-byte 8) (*)) (lambda (c) (logand 255 (char-code c)))
                 (symbol-name symbol)))))

(defun basic-auth-user (value)
  "The user name in the Authorization header VALUE (its octets as
characters), read as nginx reads $remote_user: \"Basic \" in any case, then
spaces, then base64 up to the first \"=\" (the rest ignored), decoded, up to
its first colon.  NIL (logged \"-\") when there is no such name: another
scheme, a character outside base64's alphabet or 4n+1 of them before the
\"=\", no colon, or nothing before it."
  (declare (type string value))
  (let ((n (length value)))
    (when (and (>= n 6) (string-equal "Basic " value :end2 6))
      (let* ((start (or (position #\Space value :start 6 :test-not #'char=) n))
             (end (or (position #\= value :start start) n))
             (count (- end start)))
        (flet ((digit (char)
                 (let ((code (char-code char)))
                   (cond ((<= 65 code 90) (- code 65))
                         ((<= 97 code 122) (- code 71))
                         ((<= 48 code 57) (+ code 4))
                         ((= code 43) 62)
                         ((= code 47) 63)))))
          (when (and (plusp count) (/= 1 (mod count 4))
                     (loop for i from start below end always (digit (char value i))))
            (let ((octets (make-array (floor (* 3 count) 4) :element-type '(unsigned-byte 8)))
                  (bits 0) (held 0) (k 0))
              (declare (type fixnum bits held k))
              (loop for i from start below end
                    do (setf bits (logior (ash (logand bits #xffff) 6) (digit (char value i))))
                       (incf held 6)
                       (when (>= held 8)
                         (decf held 8)
                         (setf (aref octets k) (ldb (byte 8 held) bits))
                         (incf k)))
              (let ((colon (position 58 octets :end k)))
                (when (and colon (plusp colon))
                  (map 'string #'code-char (subseq octets 0 colon)))))))))))

(declaim (inline log-line-size))
(defun log-line-size (address user method uri protocol referer agent)
  "The most octets the line of these parts can take (see FILL-LOG-LINE): the
fixed parts (a JSON line's names, the time, the status and a fixnum of
octets, under 256 octets) and each variable part escaped."
  (the fixnum (+ 320 (escaped-size address) (escaped-size user) (escaped-size uri)
                 (escaped-size referer) (escaped-size agent)
                 (if method (length (symbol-name method)) 0)
                 (if protocol (length (symbol-name protocol)) 0))))

(defun fill-log-line (buffer format address user method uri protocol status bytes referer agent)
  "Write the access-log line (its newline included) of an answer into
BUFFER (LOG-LINE-SIZE octets at least); return BUFFER and the line's length.
FORMAT is :COMBINED or :JSON; ADDRESS the peer's; USER the Basic
authentication's user name, or NIL; METHOD and PROTOCOL symbols and URI the
request target, or when METHOD is NIL, URI the request line as received
\(NIL: nothing came), for an answer the engine wrote itself; STATUS; BYTES
of body sent, or NIL when not known; REFERER and AGENT the header values, or
NIL when the request had none.  Strings from the request are escaped (see
above).  An absent field is \"-\" in the combined format, as nginx writes
it, and a present but empty one \"\"; in JSON both are \"\", as in nginx's,
and the request line of an answer of the engine's goes in \"request\",
method, uri and protocol being null."
  (declare (optimize speed) (type (or null string) user uri referer agent)
           (type string address) (type symbol method protocol)
           (type fixnum status) (type (or null fixnum) bytes))
  (multiple-value-bind (clf iso) (log-time-stamps)
    (declare (type (simple-array (unsigned-byte 8) (*)) clf iso))
    (with-line-writer (put put-octets put-text) buffer
      (flet ((put-decimal (n)
               (setf at (gallop.core:put-decimal line at n))))
        (ecase format
          (:combined
           ;; ADDRESS - USER [TIME] "METHOD URI PROTOCOL" STATUS BYTES "REFERER" "AGENT"
           (put-text address :clf)
           (put-octets (text-octets " - "))
           (if user (put-text user :clf) (put 45))
           (put-octets (text-octets " [")) (put-octets clf) (put-octets (text-octets "] \""))
           (cond (method
                  (put-octets (name-octets method)) (put 32) (put-text uri :clf) (put 32)
                  (put-octets (name-octets protocol)))
                 (uri (put-text uri :clf))
                 (t (put 45)))
           (put-octets (text-octets "\" "))
           (put-decimal status) (put 32)
           (if bytes (put-decimal bytes) (put 45))
           (put-octets (text-octets " \""))
           (if referer (put-text referer :clf) (put 45))
           (put-octets (text-octets "\" \""))
           (if agent (put-text agent :clf) (put 45))
           (put 34))
          (:json
           (put-octets (text-octets "{\"time\":\"")) (put-octets iso)
           (put-octets (text-octets "\",\"remote_addr\":\"")) (put-text address :json)
           (put-octets (text-octets "\",\"remote_user\":\"")) (when user (put-text user :json))
           (cond (method
                  (put-octets (text-octets "\",\"method\":\"")) (put-octets (name-octets method))
                  (put-octets (text-octets "\",\"uri\":\"")) (put-text uri :json)
                  (put-octets (text-octets "\",\"protocol\":\"")) (put-octets (name-octets protocol))
                  (put-octets (text-octets "\",\"status\":")))
                 (t
                  (put-octets (text-octets "\",\"method\":null,\"uri\":null,\"protocol\":null,\"request\":"))
                  (if uri
                      (progn (put 34) (put-text uri :json) (put 34))
                      (put-octets (text-octets "null")))
                  (put-octets (text-octets ",\"status\":"))))
           (put-decimal status)
           (put-octets (text-octets ",\"bytes\":"))
           (if bytes (put-decimal bytes) (put-octets (text-octets "null")))
           (put-octets (text-octets ",\"referer\":\"")) (when referer (put-text referer :json))
           (put-octets (text-octets "\",\"user_agent\":\"")) (when agent (put-text agent :json))
           (put-octets (text-octets "\"}"))))
        (put 10)))))

(defun log-access (log ex status bytes)
  "Queue LOG's line for the answer STATUS, BYTES octets of body (NIL: not
known, a streamed answer), to the request of the exchange EX (its fields
taken before the app ran).  A line that cannot be made is dropped and
counted: the answer never suffers for its log."
  (handler-case
      (let ((address (exchange-address ex)) (method (exchange-method ex))
            (uri (exchange-uri ex)) (protocol (exchange-protocol ex)))
        (if (and (stringp address) (symbolp method) (stringp uri) (symbolp protocol))
            (log-access-line log address method uri protocol
                             (exchange-agent ex) (exchange-referer ex) (exchange-authorization ex)
                             status bytes)
            (sb-ext:atomic-incf (access-log-dropped log))))
    (error ()
      (sb-ext:atomic-incf (access-log-dropped log))))
  nil)

(defun head-log-fields (buffer request)
  "The User-Agent, Referer and Authorization values (or NIL) of the checked
head REQUEST in BUFFER, repeated fields joined by \", \" as MAKE-ENV does."
  (let ((agent nil) (referer nil) (authorization nil))
    (gallop.core:do-request-fields (name-start name-end value-start value-end) request
      (flet ((join (old)
               (let ((value (latin1-string buffer value-start value-end)))
                 (if old (concatenate 'string old ", " value) value))))
        (gallop.core:octets-case (buffer name-start name-end :ignore-case t)
          ("user-agent" (setf agent (join agent)))
          ("referer" (setf referer (join referer)))
          ("authorization" (setf authorization (join authorization))))))
    (values agent referer authorization)))

(defun log-engine-answer (log c status bytes buffer start end)
  "LOG's line for an answer the engine wrote itself on C (GALLOP.CORE:MAKE-
ENGINE's LOG-ANSWER): STATUS, BYTES octets of its body sent, and the
request line received, BUFFER[START,END) (BUFFER NIL: none).  A head the
engine had accepted (its body failed) is logged as any request; else the
line as received.  In whatever thread wrote the answer: a worker puts it in
its ring, another thread (the housekeeper's 408 and 503) on the queue, both
bounded as any line is."
  (handler-case
      (let ((address (remote-address-string c))
            (request (gallop.core:connection-request c)))
        (if (and buffer (gallop.core:connection-head-pending-p c))
            (multiple-value-bind (agent referer authorization) (head-log-fields buffer request)
              (log-access-line log address (gallop.core:request-method request)
                               (latin1-string buffer (gallop.core:request-target-start request)
                                              (gallop.core:request-target-end request))
                               (if (zerop (gallop.core:request-minor request)) :http/1.0 :http/1.1)
                               agent referer authorization status bytes))
            (log-access-line log address nil (and buffer (latin1-string buffer start end)) nil
                             nil nil nil status bytes)))
    (error ()
      (sb-ext:atomic-incf (access-log-dropped log))))
  nil)

(defun log-access-line (log address method uri protocol agent referer authorization status bytes)
  "Make LOG's line (FILL-LOG-LINE; AUTHORIZATION the header's value, or NIL)
and queue it."
  (declare (optimize speed))
  (let* ((user (and authorization (basic-auth-user authorization)))
         (status (if (typep status '(integer 0 999)) status 500))
         (bytes (and (typep bytes '(integer 0 #.most-positive-fixnum)) bytes))
         (size (log-line-size address user method uri protocol referer agent))
         (format (access-log-format log)))
    (declare (type fixnum size))
    ;; Made on the stack, kept at its length: a line costs the heap only
    ;; its own octets, for as long as it waits.  A long one (a long target
    ;; or header can make it 6 times as long escaped) is made where it
    ;; stays.
    (let ((locals gallop.core:*worker-locals*))
      (if (and locals (<= size 8192))
          (let ((scratch (make-array size :element-type '(unsigned-byte 8))))
            (declare (dynamic-extent scratch))
            (multiple-value-bind (scratch length)
                (fill-log-line scratch format address user method uri protocol status bytes
                               referer agent)
              (ring-put log (worker-ring log locals) scratch length)))
          ;; Room first, at the line's longest: no line is made to be
          ;; dropped.
          (let ((before (queue-reserve log size)))
            (when before
              (let ((entry nil))
                (unwind-protect
                     (multiple-value-bind (line length)
                         (fill-log-line (make-array size :element-type '(unsigned-byte 8)) format
                                        address user method uri protocol status bytes referer agent)
                       (declare (type fixnum length))
                       (setf entry (cons (subseq line 0 length) length)))
                  (queue-put log entry size before)))))))
    nil))

(defun worker-ring (log locals)
  "This worker's ring for LOG (LOCALS: its GALLOP.CORE:*WORKER-LOCALS*),
made and listed on first use; the entries of closed logs are dropped."
  (let ((entry (assoc log (svref locals 0) :test #'eq)))
    (if entry
        (cdr entry)
        (let ((ring (make-ring sb-thread:*current-thread*)))
          ;; Listed before it is used: a stop's interrupt unwinding this
          ;; handler's thread between the two steps leaves at worst an empty
          ;; ring listed (dropped when its thread ends), never one whose
          ;; lines the log's thread does not see.
          (sb-thread:with-mutex ((access-log-rings-lock log))
            (push ring (access-log-rings log)))
          (setf (svref locals 0)
                (acons log ring (remove-if (lambda (entry) (access-log-stop (car entry)))
                                           (svref locals 0))))
          ring))))

(defun ring-put (log ring line length)
  "Append LINE[0,LENGTH) to RING, this worker's for LOG; drop it (counted)
when the log's thread has not taken enough yet.  Wakes that thread once
the ring is three quarters full."
  (declare (optimize speed) (type (simple-array (unsigned-byte 8) (*)) line)
           (type fixnum length))
  (let* ((head (ring-head ring))
         (used (- head (ring-tail ring))))
    (declare (type sb-ext:word head) (type fixnum used))
    (if (> (+ used length) +ring-bytes+)
        (sb-ext:atomic-incf (access-log-dropped log))
        (let* ((octets (ring-octets ring))
               (start (logand head (1- +ring-bytes+))))
          (declare (type fixnum start))
          (dotimes (i length)
            (setf (aref octets (logand (+ start i) (1- +ring-bytes+))) (aref line i)))
          ;; The octets before the head that covers them.
          (sb-thread:barrier (:write))
          (setf (ring-head ring) (+ head length))
          (when (and (< used (* 3 (ash +ring-bytes+ -2)))
                     (>= (+ used length) (* 3 (ash +ring-bytes+ -2))))
            (sb-thread:signal-semaphore (access-log-wake log)))))))

(defun queue-reserve (log size)
  "Count SIZE octets on LOG's queue for a line about to be made for it (in
a thread with no ring, or too long for a worker's scratch), and return the
octets counted before; NIL, counting the line as dropped, when the queue
holds its most."
  (declare (type fixnum size))
  (let ((before (sb-ext:atomic-incf (access-log-queued-bytes log) size)))
    (declare (type sb-ext:word before))
    (if (< before (access-log-max-queued-bytes log))
        before
        (progn (sb-ext:atomic-decf (access-log-queued-bytes log) size)
               (sb-ext:atomic-incf (access-log-dropped log))
               nil))))

(defun queue-put (log entry size before)
  "Push ENTRY, (LINE . LENGTH), onto LOG's queue, SIZE octets having been
reserved for it (QUEUE-RESERVE, which saw BEFORE): only LENGTH stay
counted.  ENTRY NIL (its line was not made, an error the caller counts)
gives the room back."
  (declare (type fixnum size) (type sb-ext:word before))
  (let ((length (if entry (the fixnum (cdr entry)) 0)))
    ;; Counted before it is pushed: TAKE-QUEUE never takes more than it adds.
    (sb-ext:atomic-decf (access-log-queued-bytes log) (- size length))
    (when entry
      (sb-ext:atomic-push entry (access-log-queue log))
      (when (and (< before +wake-bytes+) (>= (+ before length) +wake-bytes+))
        (sb-thread:signal-semaphore (access-log-wake log))))))

(defun access-log-stats (log)
  "LOG's losses, as a property list for GALLOP:STATS: :ACCESS-LOG-DROPPED
lines (no room, or a line that could not be made) and :ACCESS-LOG-LOST-OCTETS
\(octets the file or stream did not take)."
  (list :access-log-dropped (access-log-dropped log)
        :access-log-lost-octets (access-log-lost-octets log)))
