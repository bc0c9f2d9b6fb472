;;;; access-log.lisp -- the native API's access log: one line per answer, in
;;;; the Combined Log Format nginx and Apache write, or as JSON lines, to a
;;;; file or a stream (GALLOP:START's :ACCESS-LOG).
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
;;;; +MAX-QUEUED-BYTES+: past them lines are dropped, and counted.  A
;;;; file is opened again by its name on GALLOP:REOPEN-ACCESS-LOGS (or
;;;; SIGHUP, GALLOP:REOPEN-LOGS-ON-SIGHUP), for logrotate.

(in-package #:gallop)

(defconstant +flush-interval+ 0.05
  "Seconds between the writer's passes over the rings and the queue.")

(defconstant +wake-bytes+ (* 256 1024)
  "Octets queued that wake the writer before its interval.")

(defconstant +max-queued-bytes+ (* 32 1024 1024)
  "Octets queued past which lines are dropped (counted in ACCESS-LOG-DROPPED).")

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
  (queued-bytes 0 :type sb-ext:word)
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

(defun ascii-octets (string)
  (map '(simple-array (unsigned-byte 8) (*)) #'char-code string))

(defmacro with-line-writer ((put put-octets put-escaped) buffer &body body)
  "BODY with LINE, the octet vector BUFFER (long enough: the caller made sure
of it), and local functions that append to it: PUT an octet, PUT-OCTETS an
octet vector, PUT-ESCAPED a string escaped for STYLE :CLF or :JSON.  Returns the line and its length."
  `(let ((line ,buffer)
         (at 0))
     (declare (type (simple-array (unsigned-byte 8) (*)) line) (type fixnum at)
              ;; No bounds checks: BUFFER is as long as LOG-ACCESS-LINE's
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
              (put-code (code style)
                (declare (type fixnum code))
                (cond ((> code 255)
                       ;; Not from a request head (read as Latin-1): an app's.
                       (,put 63))
                      ((and (<= 32 code 126) (/= code 34) (/= code 92))
                       (,put code))
                      ((eq style :json)
                       (if (or (= code 34) (= code 92))
                           (progn (,put 92) (,put code))
                           ;; \u00XX: the octet (heads are read as Latin-1)
                           (progn (,put 92) (,put 117) (,put 48) (,put 48)
                                  (hex "0123456789abcdef" (logand code 255)))))
                      (t
                       ;; nginx's escape=default: \xHH
                       (,put 92) (,put 120)
                       (hex "0123456789ABCDEF" (logand code 255)))))
              (,put-escaped (string style)
                (typecase string
                  ((simple-array character (*))
                   (loop for char across string do (put-code (char-code char) style)))
                  (simple-base-string
                   (loop for char across string do (put-code (char-code char) style)))
                  (t (loop for char across (the string string)
                           do (put-code (char-code char) style))))))
       (declare (inline ,put ,put-octets hex put-code)
                (ignorable #',put-octets #',put-escaped))
       ,@body
       (values line at))))

(defmacro text-octets (string)
  "STRING (a literal, ASCII) as octets, made once."
  `(load-time-value (ascii-octets ,string) t))

(declaim (inline escaped-size))
(defun escaped-size (string)
  "The most octets STRING may take escaped (six a character)."
  (* 6 (length (the string string))))

(defun name-octets (symbol)
  "SYMBOL's name as octets, kept on its property list: a method or protocol
keyword (a token of the request line: nothing in it is escaped)."
  (or (get symbol 'log-octets)
      (setf (get symbol 'log-octets)
            (map '(simple-array (unsigned-byte 8) (*)) (lambda (c) (logand 255 (char-code c)))
                 (symbol-name symbol)))))

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
                             (or (exchange-agent ex) "") (or (exchange-referer ex) "")
                             status bytes)
            (sb-ext:atomic-incf (access-log-dropped log))))
    (error ()
      (sb-ext:atomic-incf (access-log-dropped log))))
  nil)

(defun log-access-line (log address method uri protocol agent referer status bytes)
  (declare (optimize speed))
  (let* ((method (name-octets method))
         (protocol (name-octets protocol))
         (status (if (typep status '(integer 0 999)) status 500))
         (bytes (and (typep bytes '(integer 0 #.most-positive-fixnum)) bytes))
         ;; The fixed parts (a JSON line's names, the time, the status and
         ;; a fixnum of octets: 153 octets) and every variable part escaped.
         (size (+ 256 (escaped-size referer) (escaped-size agent) (escaped-size uri)
                  (escaped-size address) (length method) (length protocol))))
    (declare (type fixnum size))
    (multiple-value-bind (clf iso) (log-time-stamps)
      (flet ((fill-line (buffer)
              (with-line-writer (put put-octets put-escaped) buffer
                (flet ((put-decimal (n)
                         (setf at (gallop.core:put-decimal line at n))))
                  (ecase (access-log-format log)
                    (:combined
                     ;; ADDRESS - - [TIME] "METHOD URI PROTOCOL" STATUS BYTES "REFERER" "AGENT"
                     (put-escaped address :clf)
                     (put-octets (text-octets " - - [")) (put-octets clf) (put-octets (text-octets "] \""))
                     (put-octets method) (put 32) (put-escaped uri :clf) (put 32)
                     (put-octets protocol) (put-octets (text-octets "\" "))
                     (put-decimal status) (put 32)
                     (if bytes (put-decimal bytes) (put 45))
                     ;; An absent field is "-", as nginx writes it.
                     (put-octets (text-octets " \""))
                     (if (plusp (length (the string referer))) (put-escaped referer :clf) (put 45))
                     (put-octets (text-octets "\" \""))
                     (if (plusp (length (the string agent))) (put-escaped agent :clf) (put 45))
                     (put 34))
                    (:json
                     (put-octets (text-octets "{\"time\":\"")) (put-octets iso)
                     (put-octets (text-octets "\",\"remote_addr\":\"")) (put-escaped address :json)
                     (put-octets (text-octets "\",\"method\":\"")) (put-octets method)
                     (put-octets (text-octets "\",\"uri\":\"")) (put-escaped uri :json)
                     (put-octets (text-octets "\",\"protocol\":\"")) (put-octets protocol)
                     (put-octets (text-octets "\",\"status\":")) (put-decimal status)
                     (put-octets (text-octets ",\"bytes\":"))
                     (if bytes (put-decimal bytes) (put-octets (text-octets "null")))
                     (put-octets (text-octets ",\"referer\":\"")) (put-escaped referer :json)
                     (put-octets (text-octets "\",\"user_agent\":\"")) (put-escaped agent :json)
                     (put-octets (text-octets "\"}"))))
                  (put 10)))))
        ;; Made on the stack, kept at its length: a line costs the heap
        ;; only its own octets, for as long as it waits.  A long one (a
        ;; long target or header can make it 6 times as long escaped) is
        ;; made where it stays.
        (let ((locals gallop.core:*worker-locals*))
          (if (and locals (<= size 8192))
              (let ((scratch (make-array size :element-type '(unsigned-byte 8))))
                (declare (dynamic-extent scratch))
                (multiple-value-bind (scratch length) (fill-line scratch)
                  (ring-put log (worker-ring log locals) scratch length)))
              (multiple-value-bind (line length)
                  (fill-line (make-array size :element-type '(unsigned-byte 8)))
                (queue-put log (subseq line 0 length) length))))))
    nil))

(defun worker-ring (log locals)
  "This worker's ring for LOG (LOCALS: its GALLOP.CORE:*WORKER-LOCALS*),
made and listed on first use; the entries of closed logs are dropped."
  (let ((entry (assoc log (svref locals 0) :test #'eq)))
    (if entry
        (cdr entry)
        (let ((ring (make-ring sb-thread:*current-thread*)))
          (setf (svref locals 0)
                (acons log ring (remove-if (lambda (entry) (access-log-stop (car entry)))
                                           (svref locals 0))))
          (sb-thread:with-mutex ((access-log-rings-lock log))
            (push ring (access-log-rings log)))
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

(defun queue-put (log line length)
  "Push LINE (LENGTH octets) onto LOG's queue, from a thread with no ring."
  (declare (type fixnum length))
  (if (>= (access-log-queued-bytes log) +max-queued-bytes+)
      (sb-ext:atomic-incf (access-log-dropped log))
      ;; Counted before it is pushed: TAKE-QUEUE never takes more than it adds.
      (let ((before (sb-ext:atomic-incf (access-log-queued-bytes log) length)))
        (declare (type sb-ext:word before))
        (sb-ext:atomic-push (cons line length) (access-log-queue log))
        (when (and (< before +wake-bytes+) (>= (+ before length) +wake-bytes+))
          (sb-thread:signal-semaphore (access-log-wake log))))))

(defun access-log-stats (log)
  "LOG's losses, as a property list for GALLOP:STATS: :ACCESS-LOG-DROPPED
lines (no room, or a line that could not be made) and :ACCESS-LOG-LOST-OCTETS
\(octets the file or stream did not take)."
  (list :access-log-dropped (access-log-dropped log)
        :access-log-lost-octets (access-log-lost-octets log)))
