;;;; bodies.lisp -- bytes in, bytes out: every response body shape the native
;;;; app API allows, holding every octet value and strings with CR, LF, NUL,
;;;; TAB and characters beyond ASCII, small (head and body in one output
;;;; buffer) and large, read back byte by byte by a strict client on
;;;; keep-alive connections, so that a body changed in flight or a wrong
;;;; Content-Length (which breaks the next answer) is seen.  The client is
;;;; READ-WIRE (tests/strict-reader.lisp), the tests' one strict response reader.
;;;;
;;;; Also the random content and the exchange runner that
;;;; tests/hunchentoot/bodies.lisp uses for Hunchentoot handlers.

(in-package #:gallop-tests)
(in-suite native)

;;; Random content, from a fixed seed

(defparameter *bodies-seed* 1313
  "The seed of the body property tests: the same cases on every run.")

(defun make-bodies-rng ()
  (sb-ext:seed-random-state *bodies-seed*))

(defun pick (rng list)
  (nth (random (length list) rng) list))

(defun utf-8-octets (string)
  "STRING in UTF-8, encoded here (not with the encoder the server uses)."
  (let ((out (make-array (* 4 (length string)) :element-type '(unsigned-byte 8) :fill-pointer 0)))
    (flet ((put (b) (vector-push b out)))
      (loop for char across string
            for c = (char-code char)
            do (cond ((< c #x80) (put c))
                     ((< c #x800)
                      (put (logior #xC0 (ash c -6)))
                      (put (logior #x80 (logand c #x3F))))
                     ((< c #x10000)
                      (put (logior #xE0 (ash c -12)))
                      (put (logior #x80 (logand (ash c -6) #x3F)))
                      (put (logior #x80 (logand c #x3F))))
                     (t
                      (put (logior #xF0 (ash c -18)))
                      (put (logior #x80 (logand (ash c -12) #x3F)))
                      (put (logior #x80 (logand (ash c -6) #x3F)))
                      (put (logior #x80 (logand c #x3F)))))))
    (coerce out '(simple-array (unsigned-byte 8) (*)))))

(defun piece-octets (piece)
  "What a body piece (string or octet vector) must arrive as."
  (if (stringp piece)
      (utf-8-octets piece)
      (coerce piece '(simple-array (unsigned-byte 8) (*)))))

(defun pieces-octets (pieces)
  (let ((all (mapcar #'piece-octets pieces)))
    (apply #'concatenate '(simple-array (unsigned-byte 8) (*)) all)))

(defparameter *special-chars*
  (list (code-char 13) (code-char 10) (code-char 0) (code-char 9)
        (code-char #xE9) (code-char #xFF) (code-char #xA0) (code-char #x80)
        (code-char #x3BB) (code-char #x7FF) (code-char #x800) (code-char #x20AC)
        (code-char #xFFFD) (code-char #xFFFF) (code-char #x10000) (code-char #x1F600)
        (code-char #x10FFFF))
  "CR, LF, NUL, TAB, latin-1 (é ÿ NBSP), and the edges of each UTF-8 length
with λ € and an emoji between.")

(defun random-size (rng)
  "A body piece size: often empty or small (head and body in one 8 KiB
output buffer), some around the buffer's size, a few of 20 and 200 KiB."
  (let ((r (random 100 rng)))
    (cond ((< r 10) 0)
          ((< r 45) (1+ (random 64 rng)))
          ((< r 70) (+ 65 (random 2000 rng)))
          ((< r 88) (+ 7600 (random 1000 rng)))
          ((< r 97) (* 20 1024))
          (t (* 200 1024)))))

(defun random-char (rng alphabet)
  "A character of ALPHABET (:ASCII, :LATIN-1 or :UNICODE), the control
characters and the edge cases weighted up."
  (let ((specials (ecase alphabet
                    (:ascii (subseq *special-chars* 0 4))
                    (:latin-1 (subseq *special-chars* 0 8))
                    (:unicode *special-chars*))))
    (if (zerop (random 4 rng))
        (pick rng specials)
        (code-char (ecase alphabet
                     (:ascii (random 128 rng))
                     (:latin-1 (random 256 rng))
                     (:unicode (let ((c (random #x11000 rng)))
                                 ;; no surrogates: they are not characters UTF-8 can carry
                                 (if (<= #xD800 c #xDFFF) (- c #x800) c))))))))

(defun random-string (rng &key (size (random-size rng))
                                (alphabet (pick rng '(:ascii :ascii :latin-1 :unicode))))
  "A random string: usually simple, sometimes a base string (when ASCII)
or a string with a fill pointer, junk past it, that must not be sent."
  (let ((chars (loop repeat size collect (random-char rng alphabet)))
        (representation (random 6 rng)))
    (cond ((and (= representation 0) (every (lambda (c) (< (char-code c) 128)) chars))
           (coerce chars 'simple-base-string))
          ((= representation 1)
           (let ((s (make-array (+ size 7) :element-type 'character :initial-element #\Z
                                           :fill-pointer size)))
             (replace s chars)
             s))
          (t (coerce chars '(simple-array character (*)))))))

(defun random-octets (rng &key (size (random-size rng)))
  "A random octet vector: every value 0-255 in turn from a random start, or
random values; sometimes with a fill pointer and junk past it."
  (let ((v (make-array size :element-type '(unsigned-byte 8)))
        (start (random 256 rng))
        (counting (zerop (random 3 rng))))
    (dotimes (i size)
      (setf (aref v i) (if counting (mod (+ start i) 256) (random 256 rng))))
    (if (zerop (random 6 rng))
        (let ((w (make-array (+ size 5) :element-type '(unsigned-byte 8) :initial-element 90
                                        :fill-pointer size)))
          (replace w v)
          w)
        v)))

(defun random-piece (rng)
  (if (zerop (random 2 rng)) (random-string rng) (random-octets rng)))

(defun all-octet-values ()
  (let ((v (make-array 256 :element-type '(unsigned-byte 8))))
    (dotimes (i 256 v) (setf (aref v i) i))))

(defun describe-piece (piece)
  (format nil "~:[octets~;~:*~A~] ~D~@[ (fill pointer)~]"
          (typecase piece
            (simple-base-string "base-string")
            (string "string"))
          (length piece) (array-has-fill-pointer-p piece)))

(defun first-difference (expected actual)
  "NIL when the octet vectors are equal, else a description of where they
first differ."
  (let ((index (mismatch expected actual))
        (*print-pretty* nil))
    (when index
      (format nil "~D octets expected, ~D received, first difference at ~D: expected ~S, received ~S"
              (length expected) (length actual) index
              (subseq expected index (min (length expected) (+ index 8)))
              (subseq actual index (min (length actual) (+ index 8)))))))

;;; Running exchanges on keep-alive connections

(defstruct exchange
  "One request of a body test and how to judge its answer."
  label                                 ; for failure messages
  target                                ; the request target
  head                                  ; a HEAD request
  check                                 ; (lambda (response)) -> list of problems
  may-close)                            ; the server may close the connection after it

(defun run-exchanges (port exchanges &key (per-connection 8) (max-failures 10))
  "Send EXCHANGES in order, PER-CONNECTION on each keep-alive connection
(the last with Connection: close, after which the server must close it),
reading each answer with READ-WIRE: a wrong Content-Length or stray bytes
break the next answer, and a body delimited by the end of the connection
must come with Connection: close.  One FiveAM check per exchange, naming
its problems.  Stops after MAX-FAILURES failed exchanges, so that a broken
server costs a bounded time.  Returns how many exchanges were checked."
  (let ((socket nil) (on-socket 0) (failures 0) (checked 0))
    (flet ((drop ()
             (when socket
               (usocket:socket-close socket)
               (setf socket nil on-socket 0))))
      (unwind-protect
           (loop for (x . more) on exchanges
                 while (< failures max-failures)
                 do (unless socket (setf socket (connect port :timeout 5)))
                    (let* ((last (or (null more) (= (1+ on-socket) per-connection)))
                           (problems '())
                           (closed nil))
                      (send socket (apply #'crlf (format nil "~:[GET~;HEAD~] ~A HTTP/1.1"
                                                         (exchange-head x) (exchange-target x))
                                          "Host: x"
                                          (and last '("Connection: close"))))
                      (incf on-socket)
                      (handler-case
                          (let ((response (read-wire socket :head-request (exchange-head x)
                                                            :persistent t)))
                            (setf problems (funcall (exchange-check x) response))
                            ;; A repeated Connection field is not "close"
                            ;; (HEADER-PROBLEMS reports the repetition).
                            (let ((close (equalp "close" (wire-header response "Connection"))))
                              (cond ((and last (not close))
                                     (push "no Connection: close after one was asked for" problems))
                                    ((and close (not last) (not (exchange-may-close x)))
                                     (push "Connection: close on a keep-alive exchange" problems)))
                              (when close
                                (setf closed t)
                                ;; no octet after the answer, then end of file
                                (handler-case (read-wire-end socket response)
                                  (wire-error (e)
                                    (push (format nil "after the last answer: ~A" e) problems))))))
                        (error (e)
                          (push (format nil "~A" e) problems)))
                      (incf checked)
                      (is (null problems) "~A:~{ ~A~^;~}" (exchange-label x) problems)
                      (when problems (incf failures))
                      (when (or problems closed last) (drop))))
        (drop)))
    checked))

(defun header-problems (response expected-headers)
  "Problems with RESPONSE's headers: EXPECTED-HEADERS ((name . value) ...,
value NIL for \"absent\") not as given, a repeated header, no Date."
  (let ((problems '())
        (names (mapcar #'car (wire-headers response))))
    (loop for (name . more) on names
          when (member name more :test #'string-equal)
            do (push (format nil "the header ~A is repeated" name) problems))
    (loop for (name . value) in expected-headers
          for got = (first (wire-header-values response name))
          unless (equal value got)
            do (push (format nil "~A: ~S expected, ~S received" name value got) problems))
    (unless (wire-header-values response "Date")
      (push "no Date" problems))
    problems))

(defun body-problems (response expected &key head streamed)
  "Problems with RESPONSE's framing and body, EXPECTED being the octets the
GET answer carries.  STREAMED: the length is unknown, so a GET answer must
be chunked (size lines of hex digits only: Gallop sends no chunk extension)
and a HEAD answer has no Content-Length."
  (let ((problems '())
        ;; READ-WIRE refuses a repeated Content-Length.
        (length (wire-header response "Content-Length")))
    (flet ((problem (control &rest arguments)
             (push (apply #'format nil control arguments) problems)))
      (cond (head
             (cond ((not streamed)
                    (unless (equal length (princ-to-string (length expected)))
                      (problem "HEAD: Content-Length ~S, ~D expected" length (length expected))))
                   (length
                    (problem "HEAD of a streamed answer: Content-Length ~S" length))))
            (t
             (let ((framing (if streamed :chunked :content-length)))
               (unless (eq framing (wire-framing response))
                 (problem "framed by ~S, ~S expected" (wire-framing response) framing)))
             (when (wire-flag-p response :chunk-extensions)
               (problem "a chunk line with an extension (chunk sizes ~S)"
                        (wire-chunk-sizes response)))
             (let ((difference (first-difference expected (wire-body response))))
               (when difference (problem "body: ~A" difference))))))
    problems))

;;; The native app's cases

(defstruct native-case
  id
  shape     ; :string :strings :mixed :octets :file :stream :stream-thread
            ; :stream-length :delayed :delayed-thread
  inner     ; for :delayed and :delayed-thread: the body's shape
  status
  pieces    ; the strings and octet vectors of the body, in order
  body      ; what the app returns as body (not for the streaming shapes)
  note      ; the X-Note header value the app gives (or NIL)
  close-with-last  ; streaming: :CLOSE T comes with the last piece
  expected) ; the octets the client must receive

(defun streamed-shape-p (shape) (member shape '(:stream :stream-thread)))

(defun expected-note (note)
  "What the header value NOTE must arrive as: CR and LF neutralised to
spaces (no header can be injected), characters beyond latin-1 as ?, and
without the whitespace around it."
  (etypecase note
    (null nil)
    (integer (princ-to-string note))
    (string (string-trim '(#\Space #\Tab)
                         (map 'string (lambda (c)
                                        (cond ((member c '(#\Return #\Linefeed)) #\Space)
                                              ((> (char-code c) 255) #\?)
                                              (t c)))
                              note)))))

(defun build-native-case (id shape pieces directory
                          &key inner (status 200) note (close-with-last nil))
  "A NATIVE-CASE whose body is PIECES in SHAPE (:FILE pieces are written
to a file in DIRECTORY)."
  (let* ((expected (pieces-octets pieces))
         (body (ecase (or inner shape)
                 (:string (assert (and (= 1 (length pieces)) (stringp (first pieces))))
                  pieces)
                 ((:strings :mixed) pieces)
                 (:octets (assert (and (= 1 (length pieces)) (not (stringp (first pieces)))))
                  (first pieces))
                 (:file (let ((path (merge-pathnames (format nil "case-~D" id) directory)))
                          (with-open-file (out path :direction :output :if-exists :supersede
                                                    :element-type '(unsigned-byte 8))
                            (write-sequence expected out))
                          path))
                 ((:stream :stream-thread :stream-length) nil))))
    (make-native-case :id id :shape shape :inner inner :status status :pieces pieces :body body
                      :note note :close-with-last close-with-last :expected expected)))

(defun native-case-label (case head)
  (format nil "case ~D ~:[GET~;HEAD~] ~(~A~)~@[/~(~A~)~] ~D ~A [~{~A~^, ~}]~@[ note ~D chars~]"
          (native-case-id case) head (native-case-shape case) (native-case-inner case)
          (native-case-status case)
          (if (native-case-close-with-last case) "close-with-last" "close-apart")
          (mapcar #'describe-piece (native-case-pieces case))
          (let ((note (native-case-note case))) (and (stringp note) (length note)))))

(defun fixed-native-cases (directory)
  "The cases every run has whatever the seed: the LF of issue 13, the
control characters, every octet value, and an empty body in each shape."
  (let ((id -1)
        (cr (string #\Return)) (lf (string #\Linefeed))
        (nul (string (code-char 0))) (tab (string #\Tab)))
    (flet ((case* (shape pieces &rest options)
             (apply #'build-native-case (incf id) shape pieces directory options)))
      (list
       (case* :string (list (format nil "a~%b")))
       (case* :string (list (concatenate 'string "x" cr lf "y" cr "z" lf nul tab "end" cr)))
       (case* :string (list (coerce (loop for i below 128 collect (code-char i)) 'string)))
       (case* :string (list (coerce (loop for i below 128 collect (code-char i)) 'simple-base-string)))
       (case* :string (list (coerce (list #\a (code-char #x3BB) (code-char #xE9) (code-char #x1F600) #\Newline)
                                    'string)))
       ;; head and body in one buffer, and just past it
       (case* :string (list (with-output-to-string (s) (dotimes (i 800) (format s "line ~3D~%" i)))))
       (case* :string (list (with-output-to-string (s) (dotimes (i 920) (format s "line ~3D~%" i)))))
       (case* :octets (list (all-octet-values)))
       (case* :mixed (list (format nil "~A~%" (code-char #x3BB)) (all-octet-values) (concatenate 'string cr lf)))
       (case* :file (list (all-octet-values)))
       (case* :stream (list (all-octet-values) (format nil "a~%b") (string (code-char #x1F600))))
       (case* :delayed (list (format nil "a~%b")) :inner :string)
       (case* :delayed-thread (list (format nil "a~Cb" #\Return)) :inner :string)
       (case* :string (list "ok") :note (concatenate 'string "a" cr lf "Injected: yes"))
       (case* :string (list "ok") :note (concatenate 'string "a" lf "Injected: yes" lf lf))
       ;; empty bodies, in each shape
       (case* :string (list ""))
       (case* :string (list (coerce "" 'simple-base-string)))
       (case* :strings '())
       (case* :strings (list "" ""))
       (case* :mixed (list "" (make-array 0 :element-type '(unsigned-byte 8))))
       (case* :octets (list (make-array 0 :element-type '(unsigned-byte 8))))
       (case* :file '())
       (case* :stream '())
       (case* :stream (list "" (make-array 0 :element-type '(unsigned-byte 8))) :close-with-last t)
       (case* :stream-thread '())
       (case* :stream-length '())
       (case* :delayed (list "") :inner :string)
       (case* :delayed (list (make-array 0 :element-type '(unsigned-byte 8))) :inner :octets)
       (case* :delayed-thread '() :inner :file)
       (case* :delayed-thread '() :inner :strings)))))

(defun random-note (rng)
  "A header value for X-Note: mostly none; strings with CR and LF (that
must not inject a header) and characters beyond latin-1; an integer, or a
value too long for the head's one-buffer path (the general path)."
  (let ((r (random 100 rng)))
    (cond ((< r 40) nil)
          ((< r 75)
           (concatenate 'string
                        ;; No other control characters: Gallop passes them
                        ;; through (a header value must not hold them).
                        (remove-if (lambda (c)
                                     (and (or (< (char-code c) 32) (= (char-code c) 127))
                                          (not (member c '(#\Return #\Linefeed #\Tab)))))
                                   (random-string rng :size (random 40 rng) :alphabet :unicode))
                        (format nil "~C~CInjected: yes" #\Return #\Linefeed)))
          ((< r 85) (random 1000000 rng))
          (t (coerce (loop repeat 9000 collect (pick rng (list #\a #\Space #\Return #\Linefeed
                                                                (code-char #xE9) (code-char #x3BB))))
                     'string)))))

(defun random-native-case (rng id directory)
  (let* ((shape (pick rng '(:string :string :string :strings :mixed :octets :file :stream
                            :stream-thread :stream-length :delayed :delayed-thread)))
         (inner (and (member shape '(:delayed :delayed-thread))
                     (pick rng '(:string :strings :mixed :octets :file))))
         (pieces (ecase (or inner shape)
                   (:string (list (random-string rng)))
                   (:strings (loop repeat (random 5 rng) collect (random-string rng)))
                   (:octets (list (random-octets rng)))
                   ((:mixed :file :stream :stream-thread :stream-length)
                    (loop repeat (random 5 rng) collect (random-piece rng))))))
    (build-native-case id shape pieces directory
                       :inner inner
                       :status (pick rng '(200 200 200 201 404 500 503))
                       :note (random-note rng)
                       :close-with-last (zerop (random 2 rng)))))

(defun native-case-headers (case)
  (let ((note (native-case-note case)))
    (list* :content-type "text/plain; charset=utf-8"
           (and note (list :x-note note)))))

(defun body-cases-app (cases spawn)
  "An app answering the request target /N with case N of the vector CASES,
in its shape.  SPAWN runs a function in a new thread (joined by the test)."
  (lambda (env)
    (let* ((case (svref cases (parse-integer (getf env :path-info) :start 1)))
           (status (native-case-status case))
           (headers (native-case-headers case))
           (pieces (native-case-pieces case)))
      (labels ((stream-to (writer)
                 (loop for (piece . more) on pieces
                       do (if (and (null more) (native-case-close-with-last case))
                              (funcall writer piece :close t)
                              (funcall writer piece)))
                 (unless (and pieces (native-case-close-with-last case))
                   (funcall writer nil :close t)))
               (full () (list status headers (native-case-body case))))
        (ecase (native-case-shape case)
          ((:string :strings :mixed :octets :file) (full))
          (:delayed (lambda (responder) (funcall responder (full))))
          (:delayed-thread (lambda (responder) (funcall spawn (lambda () (funcall responder (full))))))
          (:stream (lambda (responder) (stream-to (funcall responder (list status headers)))))
          (:stream-thread
           (lambda (responder)
             (let ((writer (funcall responder (list status headers))))
               (funcall spawn (lambda () (stream-to writer))))))
          (:stream-length
           (lambda (responder)
             (stream-to (funcall responder
                                 (list status
                                       (list* :content-length
                                              (princ-to-string (length (native-case-expected case)))
                                              headers)))))))))))

(defun native-case-problems (case head response)
  (let ((problems '()))
    (unless (eql (native-case-status case) (wire-status response))
      (push (format nil "status ~D, ~D expected" (wire-status response) (native-case-status case))
            problems))
    (append problems
            (header-problems response
                             `(("Content-Type" . "text/plain; charset=utf-8")
                               ("X-Note" . ,(expected-note (native-case-note case)))
                               ("Injected" . nil)))
            (body-problems response (native-case-expected case)
                           :head head :streamed (streamed-shape-p (native-case-shape case))))))

(test native-bodies-arrive-exactly
  "Property: whatever body the app gives, in whatever shape, the client
receives exactly its octets (strings in UTF-8), with the right framing,
on a keep-alive connection; HEAD answers carry the length and no body."
  (let* ((rng (make-bodies-rng))
         (directory (uiop:ensure-directory-pathname
                     (format nil "/tmp/gallop-bodies-~D-~D" (sb-posix:getpid) (random 1000000))))
         (threads '())
         (lock (sb-thread:make-mutex :name "body test threads"))
         (spawn (lambda (function)
                  (sb-thread:with-mutex (lock)
                    (push (sb-thread:make-thread function :name "body test responder") threads)))))
    (ensure-directories-exist directory)
    (unwind-protect
         (let* ((fixed (fixed-native-cases directory))
                (cases (coerce (append fixed
                                       (loop for id from (length fixed) repeat 160
                                             collect (random-native-case rng id directory)))
                               'simple-vector))
                (exchanges
                  (loop for case across cases
                        for id = (native-case-id case)
                        append (loop for head in (if (or (< id (length fixed)) (zerop (random 3 rng)))
                                                     '(nil t)
                                                     '(nil))
                                     collect (let ((case case) (head head))
                                               (make-exchange
                                                :label (native-case-label case head)
                                                :target (format nil "/~D" id)
                                                :head head
                                                :check (lambda (r) (native-case-problems case head r))
                                                ;; Streamed with no length: a HEAD answer
                                                ;; closes (neither length nor chunks).
                                                :may-close (and head (streamed-shape-p
                                                                      (native-case-shape case)))))))))
           (with-app (server (body-cases-app cases spawn))
             (is (= (length exchanges) (run-exchanges (native-port server) exchanges)))))
      (mapc #'sb-thread:join-thread (sb-thread:with-mutex (lock) threads))
      (uiop:delete-directory-tree directory :validate t :if-does-not-exist :ignore))))

(test native-header-values-cannot-inject-headers
  "CR and LF in a header value become spaces on both of the head writer's
paths (one buffer, and in parts for a head larger than the buffer), and
the body after such a head is still exact."
  (let ((value (format nil "a~C~CInjected: yes~Cb~Cc" #\Return #\Linefeed #\Linefeed #\Return))
        (body (format nil "x~C~Cy~%" #\Return #\Linefeed)))
    (with-app (server (lambda (env)
                        (list 200 (list :content-type "text/plain"
                                        :x-value value
                                        :x-long (if (string= (getf env :path-info) "/long")
                                                    (make-string 9000 :initial-element #\a)
                                                    "short"))
                              (list body))))
      (let ((socket (connect (native-port server) :timeout 5)))
        (unwind-protect
             (dolist (path '("/short" "/long" "/short"))
               (send socket (crlf (format nil "GET ~A HTTP/1.1" path) "Host: x"))
               (let ((r (read-wire socket :persistent t)))
                 (is (equal "a  Injected: yes b c" (wire-header r "X-Value")))
                 (is (null (wire-header r "Injected")))
                 (is (equalp (utf-8-octets body) (wire-body r)))))
          (usocket:socket-close socket))))))

(defvar *held-responder* nil
  "In the test below: (ENTERED . GO), two semaphores; GALLOP::RESPOND, called
in a thread named \"held responder\", signals ENTERED and waits for GO.")

(test an-answer-begun-before-the-worker-let-go-keeps-the-connection
  "A thread answers a request while the worker that ran the app has not yet
handed the connection over: it begins its answer before the app returns to
the worker, the worker then reaches the point where it would hand over,
and only then does the answer end.
The client gets the answer exactly, and then a second answer on the same
keep-alive connection.  (The worker used to hand the connection to the
engine while the thread wrote, and the thread then finished a connection
it never took back: closed before the second answer.)"
  (let* ((entered (sb-thread:make-semaphore :name "respond entered"))
         (go (sb-thread:make-semaphore :name "respond may go on"))
         (threads '())
         (app (lambda (env)
                (if (string= "/later" (getf env :path-info))
                    (lambda (responder)
                      (push (sb-thread:make-thread
                             (lambda () (funcall responder '(200 (:content-type "text/plain") ("later"))))
                             :name "held responder")
                            threads)
                      ;; Back to the worker only once that thread has begun
                      ;; its answer.
                      (sb-thread:wait-on-semaphore entered :timeout 10))
                    '(200 (:content-type "text/plain") ("now"))))))
    (setf *held-responder* (cons entered go))
    (sb-int:encapsulate 'gallop::respond 'held
                        (lambda (respond &rest args)
                          (when (equal "held responder"
                                       (sb-thread:thread-name sb-thread:*current-thread*))
                            (sb-thread:signal-semaphore (car *held-responder*))
                            (sb-thread:wait-on-semaphore (cdr *held-responder*) :timeout 10))
                          (apply respond args)))
    (unwind-protect
         (with-app (server app)
           (let ((socket (connect (native-port server) :timeout 5)))
             (unwind-protect
                  (progn
                    (send socket (crlf "GET /later HTTP/1.1" "Host: x"))
                    ;; The worker, back from the app, would now hand the
                    ;; connection over to the engine (parked in epoll): let
                    ;; it get there, if it does (it must wait instead).  The
                    ;; connection's state is the core's (engine.lisp's table,
                    ;; CONNECTION-STATE): no export tells :PARKED apart.
                    (wait-until (lambda ()
                                  (let ((table (gallop.core::engine-table
                                                (gallop::server-engine server))))
                                    (some (lambda (c)
                                            (and c (eq :parked (gallop.core::connection-state c))))
                                          table)))
                                :timeout 1 :interval 0.01)
                    (sb-thread:signal-semaphore go)
                    (let ((r (read-wire-or-error socket :persistent t)))
                      (is (and (wire-response-p r) (= 200 (wire-status r))
                               (equal "5" (wire-header r "Content-Length"))
                               (string= "later" (wire-body-string r)))
                          "first answer: ~A" r))
                    (send socket (crlf "GET /now HTTP/1.1" "Host: x"))
                    (let ((r (read-wire-or-error socket :persistent t)))
                      (is (and (wire-response-p r) (= 200 (wire-status r))
                               (equal "3" (wire-header r "Content-Length"))
                               (string= "now" (wire-body-string r)))
                          "second answer on the same connection: ~A" r)))
               (usocket:socket-close socket))
             (is (= 1 (length threads)))
             (mapc #'sb-thread:join-thread threads)
             (is-true (wait-until (lambda () (let ((s (gallop:stats server)))
                                               (and (zerop (getf s :suspended))
                                                    (zerop (getf s :in-flight))))))
                      "~S" (gallop:stats server))))
      (sb-int:unencapsulate 'gallop::respond 'held))))
